"""HTTP clients that hang up, and the per-request ``timeout`` that bounds their requests (issue 14), on a real server.

What tritonserver 2.51 tells the backend when an HTTP ``generate_stream`` (SSE) or
``generate`` client disconnects is pinned here, not assumed: the engine's
``generation_tokens_total`` shows whether a request ran to its ``max_tokens`` after
its client was gone or was aborted.
"""
from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from installed import need
need("tritonclient.grpc")
from test_triton_server import settled_metrics, wait_for_metrics  # noqa: E402

from pagedllm.serving.server import TritonServer  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

MAX_MODEL_LEN = 1024
# Long enough that the request is still generating when the checks run (a few seconds on a busy CPU).
LONG = {"temperature": 0, "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    repository = tmp_path_factory.mktemp("model_repository")
    (repository / "llm" / "1").mkdir(parents=True)
    bundled = Path(__file__).resolve().parents[1] / "model_repository" / "llm" / "config.pbtxt"
    (repository / "llm" / "config.pbtxt").write_text(bundled.read_text())
    (repository / "llm" / "1" / "model.json").write_text(json.dumps({
        "model": str(tiny_model_dir("llama")), "dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN,
        "num_kv_blocks": 200, "block_size": 16}))
    with TritonServer(repository) as running:
        yield running


def send_request(server: TritonServer, body: dict[str, object], path: str) -> socket.socket:
    """POST a request on a raw socket (so the test can hang up whenever it likes)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.http_port), timeout=60)
    sock.sendall(f"POST /v2/models/llm/{path} HTTP/1.1\r\nHost: {server.http_url}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def generated_after_hanging_up(server: TritonServer, body: dict[str, object], path: str) -> float:
    """Tokens the engine generated for a request whose client hung up once it was running; blocks must drain."""
    before = settled_metrics(server)
    sock = send_request(server, body, path)
    if path == "generate_stream":
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the first event is on its way: it is generating
    # Also for a stream: the metrics must show this request before the wait below may trust a
    # "nothing running" (an earlier snapshot says that too, and the request then outlives the test).
    wait_for_metrics(server, lambda m: m.get("vllm:generation_tokens_total", 0)
                     > before.get("vllm:generation_tokens_total", 0), timeout_s=120)
    sock.close()
    # A request nobody cancels runs all its tokens: allow for a slow, shared machine.
    values = wait_for_metrics(server, lambda m: m.get("vllm:num_requests_running") == 0
                              and m.get("pagedllm:kv_blocks_used") == 0, timeout_s=300)
    assert values["vllm:num_requests_running"] == 0 and values["pagedllm:kv_blocks_used"] == 0
    return values["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0.0)


def test_a_hung_up_sse_stream_is_aborted_and_frees_its_blocks(server: TritonServer) -> None:
    # tritonserver 2.51 reports a closed generate_stream connection through is_cancelled().
    generated = generated_after_hanging_up(server, {"text_input": "def main():", "stream": True, **LONG},
                                           "generate_stream")
    assert generated > 0, "the stream never generated a token: its hang-up proves nothing"
    assert generated < LONG["max_tokens"] / 2


def test_a_hung_up_non_streaming_generate_runs_to_its_end_unless_it_has_a_timeout(server: TritonServer) -> None:
    # Pinned limit of tritonserver 2.51: a closed generate (non-streaming) connection is not reported,
    # is_cancelled() stays False, and the request runs to max_tokens (docs/deployment.md: "Disconnects").
    assert generated_after_hanging_up(server, {"text_input": "class A:", **LONG}, "generate") == LONG["max_tokens"]
    # sampling_parameters.timeout bounds such a request.
    bounded = generated_after_hanging_up(server, {"text_input": "class A:", **LONG, "timeout": 0.3}, "generate")
    assert bounded < LONG["max_tokens"]


def test_a_timed_out_stream_ends_with_an_error_naming_the_timeout(server: TritonServer) -> None:
    response = requests.post(f"http://{server.http_url}/v2/models/llm/generate_stream", stream=True, timeout=120,
                             json={"text_input": "import os", "stream": True, **LONG, "timeout": 0.5})
    events = [json.loads(line[len(b"data: "):]) for line in response.iter_lines() if line.startswith(b"data: ")]
    assert "error" in events[-1], events[-1]
    assert "timed out after 0.5 s (sampling_parameters.timeout)" in events[-1]["error"]
    assert sum(1 for event in events if "text_output" in event) < LONG["max_tokens"]
    values = wait_for_metrics(server, lambda m: m.get("pagedllm:kv_blocks_used") == 0)
    assert values["pagedllm:kv_blocks_used"] == 0


def test_a_bad_timeout_is_rejected_naming_the_field(server: TritonServer) -> None:
    response = requests.post(f"http://{server.http_url}/v2/models/llm/generate", timeout=60,
                             json={"text_input": "x", "max_tokens": 2, "timeout": -1})
    assert response.status_code == 400 and "timeout" in response.json()["error"]
