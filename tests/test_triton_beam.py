"""Beam search through a real tritonserver: the same texts as offline ``LLM.generate``, one response when
streaming, and errors naming the field for combinations that cannot apply."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any
from pathlib import Path

import numpy as np
import pytest

from installed import need
grpcclient = need("tritonclient.grpc")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.engine.outputs import CompletionOutput  # noqa: E402
from pagedllm.serving.server import TritonServer  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

MODEL = "llm"
MAX_NUM_SEQS = 8
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "num_kv_blocks": 96,
               "max_num_seqs": MAX_NUM_SEQS, "block_size": 16}
PROMPT = "def main(self, value):"
BEAMS = {"beam_width": 4, "n": 3, "temperature": 0, "max_tokens": 12, "length_penalty": 0.5}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp("model_repository")
    bundled = Path(__file__).resolve().parents[1] / "model_repository" / MODEL / "config.pbtxt"
    (repository / MODEL / "1").mkdir(parents=True)
    (repository / MODEL / "config.pbtxt").write_text(bundled.read_text())
    (repository / MODEL / "1" / "model.json").write_text(json.dumps({"model": str(model_dir), **ENGINE_ARGS}))
    log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    with TritonServer(repository, log_path=log, extra_args=["--exit-timeout-secs=20"]) as running:
        yield running
        print(running.log_tail(3000))


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> list[CompletionOutput]:
    llm = LLM(model=str(model_dir), **ENGINE_ARGS)
    return llm.generate([PROMPT], SamplingParams(**BEAMS))[0].outputs


def infer(url: str, params: dict[str, object], stream: bool) -> tuple[list[dict[str, np.ndarray]], str | None]:
    """Send one request on a gRPC stream; returns every response's outputs, or the error."""
    responses: list[dict[str, np.ndarray]] = []
    errors: list[str] = []
    done = threading.Event()

    def on_response(result: Any, error: Any) -> None:
        if error is not None:
            errors.append(str(error))
            done.set()
            return
        arrays = {name: result.as_numpy(name) for name in ("text_output", "cumulative_logprob", "finish_reason")}
        if arrays["text_output"] is not None:
            responses.append(arrays)
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    inputs = []
    for name, array, kind in (
        ("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
        ("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
        ("stream", np.array([stream]), "BOOL"),
        ("exclude_input_in_output", np.array([True]), "BOOL"),
        ("return_cumulative_logprob", np.array([True]), "BOOL"),
        ("return_finish_reason", np.array([True]), "BOOL"),
    ):
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer(MODEL, inputs, request_id="beams", enable_empty_final_response=True)
        assert done.wait(120), "no final response"
    finally:
        client.stop_stream()
        client.close()
    return responses, errors[0] if errors else None


@pytest.mark.parametrize("stream", [False, True])
def test_beam_request_returns_the_offline_hypotheses_in_one_response(
    server: TritonServer, offline: list[CompletionOutput], stream: bool
) -> None:
    responses, error = infer(server.grpc_url, BEAMS, stream)
    assert error is None
    # Streaming or not, one response: beams rewrite earlier tokens, so there are no deltas.
    assert len(responses) == 1
    (response,) = responses
    assert [text.decode() for text in response["text_output"]] == [o.text for o in offline]
    assert response["cumulative_logprob"].tolist() == pytest.approx([o.cumulative_logprob for o in offline], abs=1e-4)
    assert [r.decode() for r in response["finish_reason"]] == [o.finish_reason for o in offline]


@pytest.mark.parametrize("params, field", [
    ({**BEAMS, "beam_width": MAX_NUM_SEQS + 1}, "beam_width"),
    ({**BEAMS, "n": 5}, "n"),
    ({**BEAMS, "temperature": 0.8}, "temperature"),
    ({**BEAMS, "repetition_penalty": 1.1}, "repetition_penalty"),
    ({**BEAMS, "seed": 7}, "seed"),
])
def test_impossible_beam_combinations_get_an_error_naming_the_field(
    server: TritonServer, offline: list[CompletionOutput], params: dict[str, object], field: str
) -> None:
    responses, error = infer(server.grpc_url, params, stream=False)
    assert error is not None and f"{field}=" in error, error
    # Serving carries on.
    responses, error = infer(server.grpc_url, BEAMS, stream=False)
    assert error is None and [t.decode() for t in responses[0]["text_output"]] == [o.text for o in offline]
