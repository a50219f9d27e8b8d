"""A tiny mixture of experts (Qwen2-MoE: shared expert, dense and sparse layers) served by a real tritonserver
streams exactly the offline ``LLM.generate`` tokens."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from installed import need
grpcclient = need("tritonclient.grpc")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.serving.server import TritonServer  # noqa: E402

from test_triton_server import MODEL, greedy, stream_once  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_moe")


@pytest.fixture(scope="module")
def server(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    repository = tmp_path_factory.mktemp("moe_model_repository")
    bundled = Path(__file__).resolve().parents[1] / "model_repository" / MODEL / "config.pbtxt"
    (repository / MODEL / "1").mkdir(parents=True)
    (repository / MODEL / "config.pbtxt").write_text(bundled.read_text())
    (repository / MODEL / "1" / "model.json").write_text(json.dumps({
        "model": str(moe_dir), "dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN}))
    log = tmp_path_factory.mktemp("moe_tritonserver") / "tritonserver.log"
    with TritonServer(repository, log_path=log, extra_args=["--exit-timeout-secs=20"]) as running:
        yield running
        print(running.log_tail(3000))


def test_moe_stream_equals_offline_generate_token_for_token(server: TritonServer, moe_dir: Path) -> None:
    prompt = "def main(self, value):"
    with LLM(str(moe_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN) as offline:
        expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    result = stream_once(server.grpc_url, prompt, greedy(24, logprobs=0), stream=True, return_logprobs=True)
    assert result.error is None
    assert result.text() == expected.text
    streamed_ids = [int(token) for a in result.arrays for step in json.loads(a["logprobs"][0]) for token in step]
    assert streamed_ids == expected.token_ids
