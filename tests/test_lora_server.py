"""Multi-LoRA through a real server: ``pagedllm serve --model DIR --lora-modules ... --openai-port``.

``lora_name`` over tritonclient gRPC (in sampling_parameters, as vllm_backend takes it, and as the optional input)
and ``model=<adapter>`` over the OpenAI endpoint stream the offline engine's greedy text for that adapter; unknown
adapters are clear errors that leave the server serving; runtime loading (behind its flag) adds and removes
adapters. A bad adapter given to ``serve`` fails before tritonserver starts, naming the entry.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from installed import need
openai = need("openai")
grpcclient = need("tritonclient.grpc")

from serve_process import follow, kill, wait_ready  # noqa: E402
from pagedllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedllm.platform.processes import free_port  # noqa: E402
from pagedllm.testing.lora_adapters import make_random_adapter  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 12
# max_num_seqs 2: a third request waits while two run (vllm:lora_requests_info's waiting adapters).
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 96, "max_model_len": 256, "max_loras": 2,
               "max_num_seqs": 2}


@dataclass
class Serve:
    process: subprocess.Popen[str]
    grpc_url: str
    openai_url: str
    adapters: dict[str, Path]
    metrics_url: str
    output: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": make_random_adapter(checkpoint, root / "sql", 8, 16, seed=1, std=0.2),
            "chat": make_random_adapter(checkpoint, root / "chat", 16, 8, seed=2, use_rslora=True, std=0.2,
                                        target_modules=("q_proj", "v_proj")),
            "late": make_random_adapter(checkpoint, root / "late", 4, 32, seed=3, std=0.2)}


@pytest.fixture(scope="module")
def serve(checkpoint: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    grpc, http, metrics, port = free_port(), free_port(), free_port(), free_port()
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("serve-tmp")), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(checkpoint), "--served-model-name", "base",
               *(arg for key, value in ENGINE_ARGS.items() for arg in ("--engine-arg", f"{key}={value}")),
               "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}",
               "--allow-runtime-lora-updating", "--host", "127.0.0.1", "--grpc-port", str(grpc),
               "--http-port", str(http), "--metrics-port", str(metrics), "--openai-port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = Serve(process, f"127.0.0.1:{grpc}", f"http://127.0.0.1:{port}/v1", adapters,
                    f"http://127.0.0.1:{metrics}/metrics")
    follow(process, running.output)
    try:
        wait_ready(process, running.output)
        yield running
    finally:
        kill(process)


@pytest.fixture(scope="module")
def offline(checkpoint: Path, adapters: dict[str, Path]) -> Callable[[str | None], str]:
    llm = LLM(model=str(checkpoint), enable_lora=True, max_loras=1, **{k: v for k, v in ENGINE_ARGS.items()
                                                                        if k != "max_loras"})
    ids = {name: index + 1 for index, name in enumerate(adapters)}

    def text(name: str | None) -> str:
        lora = None if name is None else LoRARequest(name, ids[name], str(adapters[name]))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return llm.generate(PROMPT, params, lora_request=lora)[0].outputs[0].text

    return text


def grpc_stream(url: str, sampling: dict[str, Any], lora_input: str | None = None) -> tuple[str, str | None]:
    """One streamed request: its text, and the error if there was one."""
    texts: list[str] = []
    errors: list[str] = []
    done = threading.Event()

    def on_response(result: Any, error: Any) -> None:
        if error is not None:
            errors.append(str(error))
            done.set()
            return
        text = result.as_numpy("text_output")
        if text is not None:
            texts.append(text[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    tensors = [("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
               ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
               ("stream", np.array([True]), "BOOL")]
    if lora_input is not None:
        tensors.append(("lora_name", np.array([lora_input.encode()], dtype=np.object_), "BYTES"))
    inputs = []
    for name, array, kind in tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
        assert done.wait(120), "no final response"
    finally:
        client.stop_stream()
        client.close()
    return "".join(texts), errors[0] if errors else None


GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def test_grpc_lora_name_streams_the_offline_tokens(serve: Serve, offline: Callable[[str | None], str]) -> None:
    texts = {name: offline(name) for name in ("sql", "chat", None)}
    assert len(set(texts.values())) == 3, "the adapters must change the output"
    assert grpc_stream(serve.grpc_url, {**GREEDY, "lora_name": "sql"}) == (texts["sql"], None)
    assert grpc_stream(serve.grpc_url, GREEDY, lora_input="chat") == (texts["chat"], None)
    assert grpc_stream(serve.grpc_url, GREEDY) == (texts[None], None)


def test_unknown_adapter_is_invalid_arg_listing_the_known_ones(serve: Serve,
                                                               offline: Callable[[str | None], str]) -> None:
    text, error = grpc_stream(serve.grpc_url, {**GREEDY, "lora_name": "nope"})
    assert error is not None and "unknown adapter 'nope'" in error and "['chat', 'sql']" in error
    assert "INVALID_ARG" in error or "invalid request" in error
    assert grpc_stream(serve.grpc_url, {**GREEDY, "lora_name": "sql"}) == (offline("sql"), None)


def test_openai_lists_adapters_and_streams_them(serve: Serve, offline: Callable[[str | None], str]) -> None:
    client = openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=120)
    assert {model.id for model in client.models.list().data} == {"base", "sql", "chat"}
    for model, adapter in (("sql", "sql"), ("chat", "chat"), ("base", None)):
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == offline(adapter)
    with pytest.raises(openai.NotFoundError, match="'nope' is not served here"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def newest_lora_requests_info(serve: Serve) -> dict[str, str] | None:
    """The labels of the vllm:lora_requests_info series a reader takes: the newest (its value is the time of its
    update, as vLLM's; older label sets stay on /metrics with their older times, as vLLM's do)."""
    text = requests.get(serve.metrics_url, timeout=10).text
    assert "# TYPE vllm:lora_requests_info gauge" in text
    series = [(float(value), dict(re.findall(r'(\w+)="([^"]*)"', labels)))
              for labels, value in re.findall(r'^vllm:lora_requests_info\{(.*)\} (\S+)$', text, re.MULTILINE)]
    assert all(time_of_update > 1e9 and labels["max_lora"] == "2" for time_of_update, labels in series), series
    return max(series, key=lambda entry: entry[0])[1] if series else None


def until_lora_info(serve: Serve, running: str, waiting: str) -> dict[str, str]:
    deadline = time.monotonic() + 60
    while True:
        labels = newest_lora_requests_info(serve)
        if labels and (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == (running, waiting):
            return labels
        assert time.monotonic() < deadline, f"never running={running!r} waiting={waiting!r}: last {labels}"
        time.sleep(0.02)


def test_lora_requests_info_shows_the_running_and_waiting_adapters(serve: Serve) -> None:
    def stream(model: str) -> str:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 240, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with requests.post(f"{serve.openai_url}/completions", json=body, stream=True, timeout=300) as answer:
            assert answer.status_code == 200, answer.text
            return "".join(line.decode() for line in answer.iter_lines())

    with ThreadPoolExecutor(3) as pool:
        first = [pool.submit(stream, "sql"), pool.submit(stream, "chat")]
        labels = until_lora_info(serve, running="chat,sql", waiting="")
        assert {key: labels[key] for key in ("max_lora", "model", "version")} == {
            "max_lora": "2", "model": "llm", "version": "1"}
        third = pool.submit(stream, "sql")  # max_num_seqs=2: it waits for one of the two
        until_lora_info(serve, running="chat,sql", waiting="sql")
        assert all("[DONE]" in done.result(timeout=300) for done in [*first, third])
    until_lora_info(serve, running="", waiting="")


def test_runtime_load_and_unload(serve: Serve, offline: Callable[[str | None], str]) -> None:
    base = serve.openai_url.removesuffix("/v1")
    bad = requests.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/nowhere"}, timeout=60)
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    loaded = requests.post(f"{base}/v1/load_lora_adapter",
                           json={"lora_name": "late", "lora_path": str(serve.adapters["late"])}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    client = openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=120)
    assert "late" in {model.id for model in client.models.list().data}
    out = client.completions.create(model="late", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == offline("late")
    assert requests.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    assert requests.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 404
    assert requests.get(f"{base}/health", timeout=10).status_code == 200


def test_serve_refuses_a_bad_adapter_naming_the_entry(checkpoint: Path, adapters: dict[str, Path],
                                                      tmp_path: Path) -> None:
    dora = make_random_adapter(checkpoint, tmp_path / "dora", 8, 16, seed=4)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    result = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(checkpoint),
                             "--lora-modules", f"sql={adapters['sql']}", f"bad={dora}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "entry 'bad'" in result.stderr and "use_dora" in result.stderr
