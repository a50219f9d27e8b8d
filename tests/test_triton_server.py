"""End to end: a real tritonserver (from the nvidia-pytriton wheel) serving a tiny random-weight model.

One server per module, on free ports. Every result is compared with the offline
``LLM.generate`` of the same checkpoint (greedy, fp32), token for token.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import requests

from installed import need
grpcclient = need("tritonclient.grpc")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.serving.server import TritonServer  # noqa: E402

MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 160
MODEL = "llm"
MINIMAL_MODEL = "llm_minimal"
MINIMAL_CONFIG = 'backend: "pagedllm"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\n'
WORDS = ["def", "class", "import", "return", "while", "for", "print", "self", "value", "lambda", "yield", "try"]


pytestmark = [pytest.mark.tritonserver, pytest.mark.server]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp("model_repository")
    engine_args = json.dumps({
        "model": str(model_dir), "dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN,
        "num_kv_blocks": NUM_KV_BLOCKS, "max_num_seqs": 64, "block_size": 16,
    })
    bundled = Path(__file__).resolve().parents[1] / "model_repository" / MODEL / "config.pbtxt"
    # MINIMAL_MODEL has a vllm_backend-style config: the backend fills in tensors and policy.
    for name, config in ((MODEL, bundled.read_text()), (MINIMAL_MODEL, MINIMAL_CONFIG)):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(config)
        (repository / name / "1" / "model.json").write_text(engine_args)
    log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    with TritonServer(repository, log_path=log, extra_args=["--exit-timeout-secs=20"]) as running:
        yield running
        print(running.log_tail(3000))


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)


def greedy(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"temperature": 0, "max_tokens": max_tokens, **extra}


def prompt_of(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 5)) + f" x{i}"


@dataclass
class StreamResult:
    texts: list[list[str]] = field(default_factory=list)  # per response: the n strings
    arrays: list[dict[str, np.ndarray]] = field(default_factory=list)
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def text(self, index: int = 0) -> str:
        return "".join(response[index] for response in self.texts)


OPTIONAL_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")


def make_inputs(prompt: str | bytes | None, params: dict[str, object] | None, **flags: object) -> list:
    inputs = []
    if prompt is not None:
        data = prompt.encode() if isinstance(prompt, str) else prompt
        inputs.append(_tensor("text_input", np.array([data], dtype=np.object_), "BYTES"))
    if params is not None:
        text = params if isinstance(params, str) else json.dumps(params)
        inputs.append(_tensor("sampling_parameters", np.array([text.encode()], dtype=np.object_), "BYTES"))
    for name, value in flags.items():
        inputs.append(_tensor(name, np.array(value if isinstance(value, list) else [value], dtype=bool), "BOOL"))
    return inputs


def _tensor(name: str, array: np.ndarray, dtype: str):
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


class StreamClient:
    """One gRPC stream; each request collects its responses into a StreamResult."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.results: dict[str, StreamResult] = {}
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        if error is not None:
            request_id = error.get_response().id if hasattr(error, "get_response") and error.get_response() else None
            target = self.results.get(request_id) if request_id else None
            for candidate in ([target] if target else [r for r in self.results.values() if not r.done.is_set()][:1]):
                candidate.error = str(error)
                candidate.done.set()
            return
        response = result.get_response()
        target = self.results[response.id]
        arrays = {name: result.as_numpy(name) for name in ("text_output", *OPTIONAL_OUTPUTS)
                  if result.as_numpy(name) is not None}
        if "text_output" in arrays:
            target.texts.append([item.decode() for item in arrays["text_output"]])
            target.arrays.append(arrays)
        if response.parameters["triton_final_response"].bool_param:
            target.done.set()

    def send(self, request_id: str, inputs: list, model: str = MODEL) -> StreamResult:
        self.results[request_id] = StreamResult()
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        return self.results[request_id]

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_once(url: str, prompt: str | bytes | None, params: dict[str, object] | str | None,
                **flags: object) -> StreamResult:
    client = StreamClient(url)
    try:
        result = client.send("one", make_inputs(prompt, params, **flags))
        assert result.done.wait(120), "no final response"
        return result
    finally:
        client.close()


def metrics(server: TritonServer, model: str = MODEL) -> dict[str, float]:
    """The vllm: and pagedllm: series of one model (histogram buckets left out)."""
    text = requests.get(server.metrics_url, timeout=10).text
    values = {}
    for line in text.splitlines():
        match = re.match(r'^((?:vllm|pagedllm):[a-z0-9_]+)\{([^}]*)\} ([0-9.e+-]+)$', line)
        if match and f'model="{model}"' in match.group(2) and 'le="' not in match.group(2):
            values[match.group(1)] = float(match.group(3))
    return values


def wait_for_metrics(server: TritonServer, condition: Callable[[dict[str, float]], bool],
                     timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    values = metrics(server)
    while not condition(values) and time.monotonic() < deadline:
        time.sleep(0.2)
        values = metrics(server)
    return values


def settled_metrics(server: TritonServer, timeout_s: float = 60) -> dict[str, float]:
    """Metrics once the engine is idle and the publisher has caught up with its last step.

    Metrics are published a little after the step that produced them, so a reading taken
    just as an earlier test's streams end can still miss their last tokens.
    """
    deadline = time.monotonic() + timeout_s
    previous = wait_for_metrics(server, lambda m: m.get("vllm:num_requests_running") == 0
                                and m.get("vllm:num_requests_waiting") == 0, timeout_s)
    while True:
        time.sleep(0.3)
        current = metrics(server)
        if current == previous:
            return current
        assert time.monotonic() < deadline, f"metrics still changing after {timeout_s} s with nothing running"
        previous = current


def test_grpc_stream_equals_offline_generate_token_for_token(server: TritonServer, offline: LLM) -> None:
    prompt = "def main(self, value):"
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    result = stream_once(server.grpc_url, prompt, greedy(24, logprobs=0), stream=True, return_logprobs=True,
                         return_num_output_tokens=True, return_finish_reason=True, return_num_input_tokens=True)
    assert result.error is None
    assert result.text() == expected.text
    streamed_ids = [int(token) for a in result.arrays for step in json.loads(a["logprobs"][0]) for token in step]
    assert streamed_ids == expected.token_ids
    assert sum(int(a["num_output_tokens"][0]) for a in result.arrays) == len(expected.token_ids)
    assert result.arrays[-1]["finish_reason"][0].decode() == expected.finish_reason
    assert int(result.arrays[0]["num_input_tokens"][0]) == len(offline.tokenizer.encode(prompt))
    assert len(result.texts) > 1  # it really streamed


def test_a_minimal_vllm_style_config_is_completed_by_the_backend(server: TritonServer, offline: LLM) -> None:
    config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config(MINIMAL_MODEL, as_json=True)["config"]
    assert config["model_transaction_policy"]["decoupled"] is True
    assert config.get("max_batch_size", 0) == 0
    assert {i["name"] for i in config["input"]} >= {"text_input", "stream", "sampling_parameters"}
    assert {o["name"] for o in config["output"]} >= {"text_output", "num_output_tokens"}
    client = StreamClient(server.grpc_url)
    try:
        result = client.send("m", make_inputs("yield", greedy(8), stream=True), model=MINIMAL_MODEL)
        assert result.done.wait(120)
    finally:
        client.close()
    expected = offline.generate(["yield"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert result.error is None and result.text() == expected


def test_http_generate_prepends_the_prompt_unless_excluded(server: TritonServer, offline: LLM) -> None:
    prompt = "import os\nclass"
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    url = f"http://{server.http_url}/v2/models/{MODEL}/generate"
    full = requests.post(url, json={"text_input": prompt, "temperature": 0, "max_tokens": 12}, timeout=120)
    assert full.status_code == 200, full.text
    assert full.json()["text_output"] == prompt + expected
    excluded = requests.post(url, json={"text_input": prompt, "exclude_input_in_output": True,
                                        "sampling_parameters": json.dumps(greedy(12))}, timeout=120)
    assert excluded.json()["text_output"] == expected


def test_http_generate_stream_sends_server_sent_events(server: TritonServer, offline: LLM) -> None:
    prompt = "for value in"
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    url = f"http://{server.http_url}/v2/models/{MODEL}/generate_stream"
    response = requests.post(url, json={"text_input": prompt, "stream": True, "temperature": "0", "max_tokens": "16"},
                             stream=True, timeout=120)
    events = [json.loads(line[len(b"data: "):]) for line in response.iter_lines() if line.startswith(b"data: ")]
    assert len(events) > 1 and all("error" not in event for event in events)
    assert "".join(event["text_output"] for event in events) == expected


def test_non_streaming_n_samples_each_carry_the_prompt(server: TritonServer) -> None:
    result = stream_once(server.grpc_url, "while", {"n": 3, "max_tokens": 6, "seed": 1}, stream=False,
                         exclude_input_in_output=False, return_num_output_tokens=True)
    assert result.error is None
    assert len(result.texts) == 1 and len(result.texts[0]) == 3
    assert all(text.startswith("while") for text in result.texts[0])
    assert result.arrays[0]["num_output_tokens"].tolist() == [6, 6, 6]


def test_64_concurrent_streams_return_their_offline_results(server: TritonServer, offline: LLM) -> None:
    prompts = [prompt_of(i) for i in range(64)]
    lengths = [4 + (i * 5) % 17 for i in range(64)]
    expected = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths])
    clients = [StreamClient(server.grpc_url) for _ in range(64)]
    try:
        results = [client.send(f"c{i}", make_inputs(prompts[i], greedy(lengths[i]), stream=True))
                   for i, client in enumerate(clients)]
        for result in results:
            assert result.done.wait(300)
    finally:
        for client in clients:
            client.close()
    assert [r.error for r in results] == [None] * 64
    assert [r.text() for r in results] == [e.outputs[0].text for e in expected]


def test_cancelled_streams_free_their_blocks(server: TritonServer) -> None:
    before = settled_metrics(server)
    max_tokens = MAX_MODEL_LEN - 32
    client = StreamClient(server.grpc_url)
    results = [client.send(f"k{i}", make_inputs(prompt_of(i), greedy(max_tokens, ignore_eos=True), stream=True))
               for i in range(16)]
    # Cancel while half the streams are decoding and the rest still run or wait for blocks (16 full streams
    # need more than the pool holds). Waiting for all 16 raced the whole run: the later ones start only as
    # earlier ones finish, and the client sees their tokens after the engine has made them.
    deadline = time.monotonic() + 120
    while sum(bool(r.texts) for r in results) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(bool(r.texts) for r in results) >= 8, "half the streams should have produced a token before the cancel"
    client.close(cancel=True)
    after = wait_for_metrics(server, lambda m: m.get("pagedllm:kv_blocks_used") == 0
                             and m.get("vllm:num_requests_running") == 0)
    assert after["pagedllm:kv_blocks_used"] == 0
    assert after["pagedllm:kv_blocks_free"] == NUM_KV_BLOCKS
    generated = after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0)
    assert generated < 16 * max_tokens  # they were stopped, not run to completion
    healthy = stream_once(server.grpc_url, "print", greedy(4), stream=True)
    assert healthy.error is None and healthy.text()


LONG_PROMPT = " ".join(WORDS * 40)


@pytest.mark.parametrize(
    ("prompt", "params", "flags", "field", "reason"),
    [
        (None, greedy(4), {}, "text_input", "missing"),
        ("", greedy(4), {}, "text_input", "empty"),
        (b"\xff\xfe\xfd", greedy(4), {}, "text_input", "UTF-8"),
        ("hi", "{not json", {}, "sampling_parameters", "not valid JSON"),
        ("hi", "[1, 2]", {}, "sampling_parameters", "JSON object"),
        ("hi", {"temprature": 0.5}, {}, "temprature", "unknown"),
        ("hi", {"max_tokens": "lots"}, {}, "max_tokens", "wrong type"),
        ("hi", {"temperature": -1}, {}, "temperature", ">= 0"),
        ("hi", {"top_p": 0}, {}, "top_p", "(0, 1]"),
        ("hi", {"top_p": 1.5}, {}, "top_p", "(0, 1]"),
        ("hi", {"max_tokens": 0}, {}, "max_tokens", ">= 1"),
        ("hi", {"max_tokens": MAX_MODEL_LEN * 4}, {}, "max_tokens", "max_model_len"),
        ("hi", {"n": 0}, {}, "SamplingParams.n", ">= 1"),
        (LONG_PROMPT, greedy(4), {}, "prompt", "max_model_len"),
        ("hi", greedy(4), {"stream": [True, False]}, "stream", "shape"),
        ("hi", greedy(4), {"stream": True, "exclude_input_in_output": False}, "exclude_input_in_output", "stream"),
    ],
)
def test_bad_input_gets_an_error_naming_the_field_and_serving_continues(
    server: TritonServer, prompt: str | bytes | None, params: dict[str, object] | str, flags: dict[str, object],
    field: str, reason: str,
) -> None:
    bad = stream_once(server.grpc_url, prompt, params, **flags)
    assert bad.error is not None, f"expected an error for {field}"
    assert field in bad.error and reason in bad.error
    good = stream_once(server.grpc_url, "def", greedy(3), stream=True)
    assert good.error is None and good.text()


def test_metrics_are_sensible_after_the_run(server: TritonServer) -> None:
    stream_once(server.grpc_url, "return self", greedy(8), stream=True)
    values = wait_for_metrics(server, lambda m: m.get("vllm:num_requests_running") == 0
                              and m.get("vllm:e2e_request_latency_seconds_count", 0) > 0)
    assert values["vllm:prompt_tokens_total"] > 0
    assert values["vllm:generation_tokens_total"] >= 8
    assert values["vllm:time_to_first_token_seconds_count"] > 0
    assert values["vllm:time_to_first_token_seconds_sum"] > 0
    assert values["vllm:time_per_output_token_seconds_count"] > 0
    assert values["vllm:e2e_request_latency_seconds_sum"] >= values["vllm:time_to_first_token_seconds_sum"]
    assert values["pagedllm:kv_blocks_used"] == 0 and values["vllm:kv_cache_usage_perc"] == 0
    assert values["pagedllm:kv_blocks_free"] == NUM_KV_BLOCKS
    assert values["vllm:num_requests_waiting"] == 0
    assert 0 <= values["vllm:prefix_cache_hits_total"] <= values["vllm:prefix_cache_queries_total"]
    assert "pagedllm:num_preemptions_total" in values
