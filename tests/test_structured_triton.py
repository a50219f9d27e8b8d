"""Structured outputs through a real tritonserver (tritonclient gRPC streaming): the offline outputs, and
INVALID_ARG naming structured_outputs for a constraint xgrammar rejects or one refused up front."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.serving.server import TritonServer  # noqa: E402
from pagedllm.testing.structured_corpus import ARITHMETIC_EBNF, JSON_SCHEMAS, REGEXES  # noqa: E402

pytestmark = pytest.mark.tritonserver

MODEL = "llm"
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "num_kv_blocks": 96, "max_num_seqs": 8}
PROMPT = "Answer in the format:"
# The same constraints in each of the ways Triton's sampling_parameters take them.
REQUESTS = [
    {"structured_outputs": {"json": JSON_SCHEMAS[15]}},
    {"structured_outputs": json.dumps({"json": json.dumps(JSON_SCHEMAS[1])})},
    {"guided_decoding": {"regex": REGEXES[0]}},
    {"structured_outputs": {"choice": ["red", "green", "blue"]}},
    {"structured_outputs": {"grammar": ARITHMETIC_EBNF}},
]


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


def infer(url: str, params: dict[str, Any], stream: bool) -> tuple[str, str | None, str | None]:
    """One request on a gRPC stream: its whole text, finish reason, and the error if any."""
    texts: list[str] = []
    reasons: list[str] = []
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
            reasons.append(result.as_numpy("finish_reason")[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    inputs = []
    for name, array, kind in (
        ("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
        ("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
        ("stream", np.array([stream]), "BOOL"),
        ("exclude_input_in_output", np.array([True]), "BOOL"),
        ("return_finish_reason", np.array([True]), "BOOL"),
    ):
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer(MODEL, inputs, request_id="structured", enable_empty_final_response=True)
        assert done.wait(120), "no final response"
    finally:
        client.stop_stream()
        client.close()
    return "".join(texts), reasons[-1] if reasons else None, errors[0] if errors else None


@pytest.mark.parametrize("stream", [False, True])
def test_constraints_give_the_offline_outputs(server: TritonServer, model_dir: Path, stream: bool) -> None:
    sampling = [{"temperature": 0.8, "seed": i, "max_tokens": 120, **extra} for i, extra in enumerate(REQUESTS)]
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    offline = llm.generate([PROMPT] * len(sampling), [_offline_params(values) for values in sampling])
    for values, expected in zip(sampling, offline):
        text, reason, error = infer(server.grpc_url, values, stream)
        assert error is None
        assert (text, reason) == (expected.outputs[0].text, expected.outputs[0].finish_reason) == (text, "stop")


def _offline_params(values: dict[str, Any]) -> SamplingParams:
    values = dict(values)
    if "guided_decoding" in values:
        values["structured_outputs"] = values.pop("guided_decoding")
    return SamplingParams.from_dict(values)


@pytest.mark.parametrize("constraint, reason", [
    ({"json": {"type": "objectx"}}, "rejected by xgrammar"),  # found when it compiles, in the engine
    ({"json": {"enum": [f"value-{i}" for i in range(100_000)]}}, "at most 65536"),  # refused up front
])
def test_a_bad_constraint_is_invalid_arg_naming_the_field(server: TritonServer, constraint: dict[str, Any],
                                                          reason: str) -> None:
    _, _, error = infer(server.grpc_url, {"max_tokens": 8, "structured_outputs": constraint}, stream=True)
    # "invalid request:" is how backend/model.py opens its INVALID_ARG messages (a stream error carries no code).
    assert error is not None and error.startswith("invalid request:") and "SamplingParams.structured_outputs" in error
    assert reason in error
    text, reason_after, error = infer(server.grpc_url, {"max_tokens": 4, "temperature": 0}, stream=False)
    assert error is None and reason_after == "length"  # serving carries on
