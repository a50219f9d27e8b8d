"""No single request can wedge or poison the server: bad requests sent while a long good stream runs.

A real tritonserver (from the nvidia-pytriton wheel) serves a tiny checkpoint with
``max_num_seqs`` 64. While one long greedy stream runs, each bad request of the table
below is sent on its own and must get an error naming the field while the good stream
is still running, i.e. without queueing behind it (the requests that look odd but are
valid must succeed, token-exact against offline). No wall-clock bound: CI machines
stall for a second now and then, and a fast one may finish the good stream early: a
fresh good stream then takes over. Every good stream must finish with exactly its
offline tokens, and every KV block must be free again. ``pytest -s`` prints the table of requests and the errors they got.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from installed import need
grpcclient = need("tritonclient.grpc")

from test_triton_server import StreamClient, StreamResult, make_inputs, metrics, wait_for_metrics  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.serving.server import TritonServer  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

MAX_MODEL_LEN = 1024
NUM_KV_BLOCKS = 256
MAX_NUM_SEQS = 64
VOCAB = 2048  # the tiny checkpoint's vocabulary
GOOD_PROMPT = "def handler(self, request):"
GOOD_TOKENS = 1000


@dataclass(frozen=True)
class Case:
    name: str
    params: dict[str, object] | str | bytes | None
    expect: tuple[str, ...]  # substrings of the error; empty: the request must succeed
    prompt: str | bytes = "def f(x):"


WRONG_TYPES: dict[str, object] = {
    "n": "many", "temperature": [1], "top_p": {"p": 1}, "top_k": 1.5, "min_p": "x", "repetition_penalty": True,
    "presence_penalty": [], "frequency_penalty": {}, "seed": "abc", "max_tokens": 2.5, "min_tokens": [],
    "stop": 5, "stop_token_ids": "abc", "include_stop_str_in_output": "maybe", "ignore_eos": 2,
    "logprobs": "lots", "skip_special_tokens": [1],
}

CASES: tuple[Case, ...] = (
    Case("n above max_num_seqs", {"n": MAX_NUM_SEQS + 1, "max_tokens": 4}, ("n", str(MAX_NUM_SEQS))),
    Case("n = 10,000", {"n": 10_000, "max_tokens": 4}, ("n", str(MAX_NUM_SEQS))),
    Case("stop id outside the vocabulary, with min_tokens",
         {"stop_token_ids": [10_000_000], "min_tokens": 4, "max_tokens": 8}, ("stop_token_ids",)),
    Case("stop id = vocabulary size", {"stop_token_ids": [VOCAB], "max_tokens": 4}, ("stop_token_ids",)),
    Case("negative stop id", {"stop_token_ids": [-1], "max_tokens": 4}, ("stop_token_ids",)),
    *(Case(f"wrong JSON type for {key}", {key: value}, (key,)) for key, value in WRONG_TYPES.items()),
    Case("sampling_parameters not JSON", "{", ("sampling_parameters", "JSON")),
    Case("sampling_parameters a JSON list", "[1, 2]", ("sampling_parameters", "object")),
    Case("stop: a 100,000-character string of '['", json.dumps({"stop": "[" * 100_000}), ("stop", "at most")),
    Case("sampling_parameters nested 100,000 deep", '{"stop": ' + "[" * 100_000 + "]" * 100_000 + "}",
         ("sampling_parameters",)),
    Case("temperature NaN (string)", {"temperature": "NaN"}, ("temperature", "finite")),
    Case("temperature NaN (JSON literal)", '{"temperature": NaN}', ("temperature", "finite")),
    Case("top_p Infinity", {"top_p": "Infinity"}, ("top_p", "finite")),
    Case("repetition_penalty -Infinity (JSON literal)", '{"repetition_penalty": -Infinity}',
         ("repetition_penalty", "finite")),
    Case("temperature 1e400", '{"temperature": 1e400}', ("temperature", "finite")),
    Case("max_tokens negative", {"max_tokens": -1}, ("max_tokens", ">= 1")),
    Case("max_tokens zero", {"max_tokens": 0}, ("max_tokens", ">= 1")),
    Case("max_tokens beyond max_model_len", {"max_tokens": 10**12}, ("max_tokens",)),
    Case("1 MB prompt", {"max_tokens": 4}, ("text_input",), prompt="x" * (1 << 20)),
    Case("10,000 stop strings", {"stop": [f"s{i}" for i in range(10_000)]}, ("stop", "at most")),
    Case("a 100,000-character stop string", {"stop": ["y" * 100_000]}, ("stop", "at most")),
    Case("huge logprobs", {"logprobs": 10**9, "max_tokens": 4}, ("logprobs",)),
    Case("unknown key", {"temprature": 0.5}, ("temprature", "unknown")),
    Case("unknown key beside known ones", {"max_tokens": 4, "best_of": 3}, ("best_of", "unknown")),
    Case("non-UTF-8 prompt", {"max_tokens": 4}, ("text_input", "UTF-8"), prompt=b"\xff\xfe\xfd"),
    Case("non-UTF-8 sampling_parameters", b'{"stop": "\xff"}', ("sampling_parameters", "UTF-8")),
    Case("empty prompt", {"max_tokens": 4}, ("text_input", "empty"), prompt=""),
    # Odd-looking but valid: these must succeed, token-exact against offline.
    Case("stop string that looks like JSON", {"stop": "[INST]", "temperature": 0, "max_tokens": 12}, ()),
    Case("stop as a JSON list of strings", {"stop": '["[INST]", "</s>"]', "temperature": 0, "max_tokens": 12}, ()),
    Case("temperature 1e-30 samples greedily", {"temperature": 1e-30, "max_tokens": 12}, ()),
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


# A pagedllm model with a test hook, served through Triton's plain "python" backend: the
# prompt KILL_PROMPT kills its engine loop (an error no ``except Exception`` catches).
DYING_MODEL = "llm_dying"
KILL_PROMPT = "__kill_the_engine_loop__"
DYING_MODEL_PY = f'''
from pagedllm.serving.triton.model import TritonPythonModel as PagedLLMModel


class InjectedFault(BaseException):
    pass


class TritonPythonModel(PagedLLMModel):
    def initialize(self, args):
        super().initialize(args)
        add_request = self._engine.add_request

        def hooked(request_id, prompt, params):
            if prompt == {KILL_PROMPT!r}:
                raise InjectedFault("injected engine-loop fault")
            add_request(request_id, prompt, params)

        self._engine.add_request = hooked
'''


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp("model_repository")
    bundled = Path(__file__).resolve().parents[1] / "model_repository" / "llm" / "config.pbtxt"
    engine_args = json.dumps({
        "model": str(model_dir), "dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN,
        "num_kv_blocks": NUM_KV_BLOCKS, "max_num_seqs": MAX_NUM_SEQS})
    for name, backend in (("llm", "pagedllm"), (DYING_MODEL, "python")):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(
            bundled.read_text().replace('backend: "pagedllm"', f'backend: "{backend}"'))
        (repository / name / "1" / "model.json").write_text(engine_args)
    (repository / DYING_MODEL / "1" / "model.py").write_text(DYING_MODEL_PY)
    log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    with TritonServer(repository, log_path=log) as running:
        yield running
        print(running.log_tail(3000))


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)


def _send(client: StreamClient, request_id: str, case: Case) -> tuple[StreamResult, float]:
    inputs = make_inputs(case.prompt, None, stream=True)
    if case.params is not None:
        raw = case.params if isinstance(case.params, bytes) else (
            case.params if isinstance(case.params, str) else json.dumps(case.params)).encode()
        parameters = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        parameters.set_data_from_numpy(np.array([raw], dtype=np.object_))
        inputs.append(parameters)
    started = time.monotonic()
    result = client.send(request_id, inputs)
    assert result.done.wait(60), f"{case.name}: no final response"
    return result, time.monotonic() - started


def _expected_text(offline: LLM, case: Case) -> str:
    assert isinstance(case.params, dict)
    values = {k: v for k, v in case.params.items() if k != "stop"}
    stop = case.params.get("stop")
    stop_list = json.loads(stop) if isinstance(stop, str) and stop.startswith('["') else [stop] if stop else []
    params = SamplingParams(**{**values, "temperature": 0.0}, stop=stop_list)
    return offline.generate([case.prompt], params)[0].outputs[0].text


def test_bad_requests_fail_alone_while_a_long_stream_runs(server: TritonServer, offline: LLM) -> None:
    good_params = {"temperature": 0, "max_tokens": GOOD_TOKENS, "ignore_eos": True}
    expected = offline.generate([GOOD_PROMPT], SamplingParams(**good_params))[0].outputs[0]
    good_client = StreamClient(server.grpc_url)
    bad_client = StreamClient(server.grpc_url)
    goods: list[StreamResult] = []
    rows: list[str] = []
    problems: list[str] = []

    def running_good_stream() -> StreamResult:
        # A fast machine may finish one good stream before the table is through; a fresh
        # one then takes over, so "answered while a good stream ran" never hangs on speed.
        if goods and not goods[-1].done.is_set():
            return goods[-1]
        good = good_client.send(f"good{len(goods)}", make_inputs(
            GOOD_PROMPT, good_params, stream=True, return_num_output_tokens=True))
        goods.append(good)
        deadline = time.monotonic() + 60
        while not good.texts:
            assert time.monotonic() < deadline and not good.done.is_set(), good.error
            time.sleep(0.05)
        return good

    try:
        for index, case in enumerate(CASES):
            # A request queued behind the good stream is answered only after it finishes;
            # one that finishes by chance meanwhile gets a second try beside a fresh stream.
            for attempt in range(2):
                good = running_good_stream()
                result, elapsed = _send(bad_client, f"bad{index}-{attempt}", case)
                if not good.done.is_set():
                    break
            else:
                problems.append(f"{case.name}: answered only after the good stream had finished, twice")
            rows.append(f"| {case.name} | {elapsed:.2f} s | {result.error or 'OK: ' + repr(result.text()[:40])} |")
            if case.expect:
                if result.error is None:
                    problems.append(f"{case.name}: succeeded, expected an error naming {case.expect}")
                elif not all(part in result.error for part in case.expect):
                    problems.append(f"{case.name}: error {result.error!r} does not name {case.expect}")
            elif result.error is not None:
                problems.append(f"{case.name}: failed with {result.error!r}, expected success")
            elif isinstance(case.params, dict) and result.text() != _expected_text(offline, case):
                problems.append(f"{case.name}: {result.text()!r} differs from offline")
        assert all(good.done.wait(300) for good in goods), "a good stream did not finish"
    finally:
        good_client.close()
        bad_client.close()
    print(f"\n{len(goods)} good stream(s)\n| request | answered after | error |\n|---|---|---|\n" + "\n".join(rows))
    for good in goods:
        assert good.error is None, good.error
        assert good.text() == expected.text
        assert sum(int(a["num_output_tokens"].sum()) for a in good.arrays) == len(expected.token_ids) == GOOD_TOKENS
    assert not problems, "\n".join(problems)
    after = wait_for_metrics(server, lambda m: m.get("pagedllm:kv_blocks_used") == 0)
    assert after["pagedllm:kv_blocks_used"] == 0
    assert metrics(server)["pagedllm:kv_blocks_free"] == NUM_KV_BLOCKS


def _model_ready(server: TritonServer, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=5) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False


def test_a_dead_engine_loop_fails_its_streams_and_the_model_stops_reporting_ready(
        server: TritonServer, offline: LLM) -> None:
    client = StreamClient(server.grpc_url)
    killer = StreamClient(server.grpc_url)
    try:
        assert _model_ready(server, DYING_MODEL)
        params = {"temperature": 0, "max_tokens": 800, "ignore_eos": True}
        running = client.send("running", make_inputs(GOOD_PROMPT, params, stream=True), model=DYING_MODEL)
        deadline = time.monotonic() + 60
        while not running.texts:
            assert time.monotonic() < deadline and not running.done.is_set(), running.error
            time.sleep(0.05)
        kill = killer.send("kill", make_inputs(KILL_PROMPT, {"max_tokens": 2}, stream=True), model=DYING_MODEL)
        assert kill.done.wait(30) and running.done.wait(30)
        for result in (kill, running):
            assert result.error is not None and "injected engine-loop fault" in result.error, result.error
        deadline = time.monotonic() + 30
        while _model_ready(server, DYING_MODEL) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _model_ready(server, DYING_MODEL)
        later = client.send("later", make_inputs("def", {"max_tokens": 2}, stream=True), model=DYING_MODEL)
        assert later.done.wait(30) and later.error is not None
    finally:
        client.close(cancel=True)
        killer.close(cancel=True)
    # The other model of the same server is untouched.
    assert _model_ready(server, "llm")
    check = StreamClient(server.grpc_url)
    try:
        result = check.send("check", make_inputs("def main(self):", {"temperature": 0, "max_tokens": 8}, stream=True))
        assert result.done.wait(60) and result.error is None
    finally:
        check.close()
    assert result.text() == offline.generate(["def main(self):"], SamplingParams(temperature=0, max_tokens=8))[
        0].outputs[0].text
