"""The official ``openai`` client against ``pagedllm serve --model HUB_ID --openai-port``, end to end.

One ``pagedllm serve`` process for the module, started the way a user would: the model
is a hub id found offline in a hub cache built here (a tiny checkpoint whose tokenizer
gets a chat template written by this test), so the CLI generates the model repository,
tritonserver serves it, and every OpenAI request travels HTTP -> gRPC stream -> Triton ->
engine. Texts are compared with the offline ``LLM`` on the same checkpoint (greedy,
fp32), token counts with the tokenizer's.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from installed import need
openai = need("openai")

from transformers import AutoTokenizer, PreTrainedTokenizerBase  # noqa: E402

from serve_process import follow, kill, wait_ready  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.platform.processes import child_pids, free_port  # noqa: E402
from pagedllm.testing.hub_cache import add_to_hub_cache  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

REPO_ID = "pagedllm-test/tiny-chat"
SERVED_NAME = "tiny-chat"
MAX_MODEL_LEN = 1024
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}]


@dataclass
class Serve:
    process: subprocess.Popen[str]
    tmpdir: Path  # the serve process's TMPDIR: its scratch folders live here
    openai_url: str
    metrics_url: str
    output: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a chat template, as it sits in a hub cache under ``REPO_ID``."""
    snapshot = add_to_hub_cache(tmp_path_factory.mktemp("hf_home") / "hub", REPO_ID, tiny_model_dir("llama"))
    (snapshot / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return snapshot


@pytest.fixture(scope="module")
def serve(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    hf_home = checkpoint.parents[3]
    tmpdir = tmp_path_factory.mktemp("serve-tmp")
    grpc, http, metrics, port = free_port(), free_port(), free_port(), free_port()
    # One torch thread, as in these tests' offline runs; it also leaves cpu_bind auto a CPU to bind on CI's two.
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", REPO_ID, "--served-model-name", SERVED_NAME,
               "--engine-arg", "dtype=float32", "--engine-arg", "device=cpu", "--engine-arg", "num_kv_blocks=160",
               "--engine-arg", f"max_model_len={MAX_MODEL_LEN}", "--host", "127.0.0.1", "--grpc-port", str(grpc),
               "--http-port", str(http), "--metrics-port", str(metrics), "--openai-port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = Serve(process, tmpdir, f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{metrics}/metrics")
    follow(process, running.output)
    try:
        wait_ready(process, running.output)
        yield running
    finally:
        kill(process)


@pytest.fixture(scope="module")
def client(serve: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLM:
    return LLM(model=str(checkpoint), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=160)


def chat_prompt(tokenizer: PreTrainedTokenizerBase) -> str:
    return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def greedy(offline: LLM, prompt: str, max_tokens: int, **extra: object) -> tuple[str, int]:
    out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, **extra))[0].outputs[0]
    return out.text, len(out.token_ids)


def metric(metrics_url: str, name: str) -> float:
    text = requests.get(metrics_url, timeout=10).text
    match = re.search(rf"^(?:vllm|pagedllm):{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} is missing from /metrics"
    return float(match.group(1))


def test_models_lists_the_served_name(client: openai.OpenAI, serve: Serve) -> None:
    assert [model.id for model in client.models.list()] == [SERVED_NAME]
    assert requests.get(serve.openai_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="cpu_bind binds nothing on one CPU")
def test_the_front_door_runs_on_the_serving_cpus_off_the_engines(serve: Serve) -> None:
    [server] = [pid for pid in child_pids(serve.process.pid)
                if Path(f"/proc/{pid}/exe").resolve().name == "tritonserver"]
    serving = frozenset(os.sched_getaffinity(server))
    assert serving < frozenset(os.sched_getaffinity(0))  # cpu_bind auto moved tritonserver off the engine's CPU
    for task in os.listdir(f"/proc/{serve.process.pid}/task"):
        assert frozenset(os.sched_getaffinity(int(task))) == serving


def test_chat_matches_offline_generation_and_counts_usage(client: openai.OpenAI, tokenizer, offline: LLM) -> None:
    prompt = chat_prompt(tokenizer)
    expected, num_tokens = greedy(offline, prompt, 12)
    reply = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert reply.usage.completion_tokens == num_tokens == 12


def test_chat_stream_adds_up_to_the_same_text_and_ends_with_usage(client: openai.OpenAI, tokenizer,
                                                                   offline: LLM) -> None:
    expected, _ = greedy(offline, chat_prompt(tokenizer), 12)
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1, "the text came in one piece"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(tokenizer(chat_prompt(tokenizer)).input_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_match_offline_generation(client: openai.OpenAI, tokenizer, offline: LLM) -> None:
    prompt = "import os\nclass Config:"
    expected, num_tokens = greedy(offline, prompt, 10)
    reply = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, temperature=0, seed=3)
    assert reply.choices[0].text == expected
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(tokenizer(prompt).input_ids), num_tokens)
    streamed = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected
    echoed = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, temperature=0, echo=True,
                                       logprobs=1)
    assert echoed.choices[0].text == prompt + expected
    logprobs = echoed.choices[0].logprobs
    # echo: the prompt's tokens come first (the first without a logprob), then the completion's
    num_prompt = len(tokenizer(prompt).input_ids)
    assert "".join(logprobs.tokens[num_prompt:]) == expected and len(logprobs.token_logprobs) == num_prompt + num_tokens
    assert logprobs.text_offset[num_prompt] == len(prompt) and logprobs.top_logprobs[0] is None
    assert all(len(top) == 1 for top in logprobs.top_logprobs[num_prompt:])


def test_n_samples_and_stop_strings(client: openai.OpenAI, offline: LLM) -> None:
    prompt = "def main():\n"
    full, _ = greedy(offline, prompt, 16)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    expected, num_tokens = greedy(offline, prompt, 16, stop=[stop])
    reply = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=16, temperature=0, n=2, stop=stop)
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [(0, expected, "stop"), (1, expected, "stop")]
    assert reply.usage.completion_tokens == 2 * num_tokens
    sampled = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8, n=2, seed=7,
                                             temperature=1.0)
    assert [c.index for c in sampled.choices] == [0, 1] and sampled.usage.completion_tokens == 16


def test_logprobs_list_the_chosen_token_and_the_top_alternatives(client: openai.OpenAI, tokenizer,
                                                                 offline: LLM) -> None:
    out = offline.generate([chat_prompt(tokenizer)], SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    expected = out[0].outputs[0]
    reply = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in expected.token_ids]
    for entry, token_id, candidates in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(candidates[token_id], abs=1e-4)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)


def test_echo_with_logprobs_returns_the_prompt_tokens_logprobs(client: openai.OpenAI, tokenizer,
                                                               offline: LLM) -> None:
    """What lm-evaluation-harness's loglikelihood requests send and read."""
    prompt = "import os\nimport sys\n\ndef main():"
    out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    reply = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                      logprobs=1)
    logprobs = reply.choices[0].logprobs
    ids = out.prompt_token_ids
    assert reply.choices[0].text.startswith(prompt)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids] + [tokenizer.decode(out.outputs[0].token_ids)]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(ids)):
        expected = out.prompt_logprobs[position]
        assert logprobs.token_logprobs[position] == pytest.approx(expected[ids[position]], abs=1e-4)
        [(_, best_logprob)] = logprobs.top_logprobs[position].items()
        assert best_logprob == pytest.approx(max(expected.values()), abs=1e-4)
    assert logprobs.text_offset[0] == 0 and len(logprobs.text_offset) == len(ids) + 1


def test_bad_requests_get_openai_errors_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature") as engine_refusal:
        client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=4, temperature=-1)
    assert engine_refusal.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="max_tokens") as schema_refusal:
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=0)
    assert schema_refusal.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="top_p"):
        next(iter(client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=4, top_p=7, stream=True)))
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "while-waiting"])
def test_a_client_disconnect_cancels_the_request_and_frees_its_blocks(serve: Serve, stream: bool) -> None:
    max_tokens = MAX_MODEL_LEN - 32
    body = {"model": SERVED_NAME, "prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    generated_before = metric(serve.metrics_url, "generation_tokens_total")
    address = urlsplit(serve.openai_url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        events = [response.readline() for _ in range(6)]  # three events, each "data: {...}" and a blank line
        assert all(line.startswith(b"data: {") for line in events[::2]), events
    deadline = time.monotonic() + 60
    while metric(serve.metrics_url, "kv_blocks_used") == 0:  # the gauge is refreshed every few steps
        assert time.monotonic() < deadline, "kv_blocks_used never rose while the request was running"
        time.sleep(0.05)
    connection.close()
    deadline = time.monotonic() + 60
    while metric(serve.metrics_url, "kv_blocks_used") != 0:
        assert time.monotonic() < deadline, "the cancelled request's KV blocks were not freed"
        time.sleep(0.1)
    generated = metric(serve.metrics_url, "generation_tokens_total") - generated_before
    assert 0 < generated < max_tokens, "the request ran to its end instead of being cancelled"


def test_ctrl_c_stops_both_servers_and_removes_the_generated_repository(serve: Serve) -> None:
    scratch = list(serve.tmpdir.glob("pagedllm-serve-*"))
    assert len(scratch) == 1 and (scratch[0] / "llm" / "1" / "model.json").is_file()
    model_json = json.loads((scratch[0] / "llm" / "1" / "model.json").read_text())
    assert model_json["max_model_len"] == MAX_MODEL_LEN and "snapshots" in model_json["model"]
    serve.process.send_signal(signal.SIGINT)
    assert serve.process.wait(timeout=120) == 0, "".join(serve.output[-40:])
    assert not list(serve.tmpdir.glob("pagedllm-*")), "scratch folders were left behind"
    with pytest.raises(requests.ConnectionError):
        requests.get(serve.openai_url + "/models", timeout=5)
