"""TritonPythonModel's glue, driven in-process through a stand-in for triton_python_backend_utils.

The real server tests (test_triton_server.py) cover the wire; these cover what is hard
to provoke there: shutdown with requests in flight, and exactly which responses and
flags each request gets.
"""
from __future__ import annotations

import importlib
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

FINAL = 1


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self._array = name, array

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self.outputs = {t.name: t.as_numpy() for t in output_tensors or []}
        self.error = error


class TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = "INTERNAL", "INVALID_ARG", "UNAVAILABLE", "CANCELLED"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self.message, self.code = message, code


class Metric:
    def __init__(self) -> None:
        self.value = 0.0
        self.observed: list[float] = []

    def increment(self, value: float) -> None:
        self.value += value

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        self.observed.append(value)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict[str, Metric] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> Metric:  # noqa: N802
        MetricFamily.created[self.name] = Metric()
        return MetricFamily.created[self.name]


class Sender:
    def __init__(self) -> None:
        self.responses: list[tuple[InferenceResponse | None, int]] = []
        self.cancelled = False
        self.finished = threading.Event()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        assert not self.finished.is_set(), "nothing may follow the FINAL flag"
        self.responses.append((response, flags))
        if flags & FINAL:
            self.finished.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def text(self) -> str:
        return "".join(r.outputs["text_output"][0].decode() for r, _ in self.responses if r and r.outputs)


class Request:
    def __init__(self, inputs: dict[str, np.ndarray], parameters: dict[str, object] | None = None) -> None:
        self.inputs, self._parameters, self.sender = inputs, parameters or {}, Sender()

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def request_id(self) -> str:
        return ""

    def get_response_sender(self) -> Sender:
        return self.sender


def fake_pb_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor, module.InferenceResponse, module.TritonError = Tensor, InferenceResponse, TritonError
    module.MetricFamily, module.TritonModelException = MetricFamily, RuntimeError
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    module.Logger = types.SimpleNamespace(log_info=print, log_warn=print, log_error=print, log_verbose=print)
    module.get_input_tensor_by_name = lambda request, name: (
        Tensor(name, request.inputs[name]) if name in request.inputs else None)
    module.using_decoupled_model_transaction_policy = (
        lambda config: config.get("model_transaction_policy", {}).get("decoupled", False))
    return module


@pytest.fixture
def model(tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    sys.modules.pop("pagedllm.serving.triton.model", None)
    module = importlib.import_module("pagedllm.serving.triton.model")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.json").write_text(json.dumps(
        {"model": str(tiny_model_dir("llama")), "dtype": "float32", "device": "cpu", "num_kv_blocks": 64,
         "max_model_len": 256}))
    instance = module.TritonPythonModel()
    instance.initialize({"model_config": json.dumps({"model_transaction_policy": {"decoupled": True}}),
                         "model_repository": str(tmp_path), "model_version": "1", "model_name": "llm"})
    yield instance
    instance.finalize()
    sys.modules.pop("pagedllm.serving.triton.model", None)


def generate_request(prompt: str, sampling: dict[str, object], stream: bool = True) -> Request:
    return Request({"text_input": np.array([prompt.encode()], dtype=np.object_), "stream": np.array([stream]),
                    "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_)})


def test_streams_deltas_then_final_and_matches_offline(model, tiny_model_dir) -> None:
    request = generate_request("def main():", {"temperature": 0, "max_tokens": 10})
    model.execute([request])
    assert request.sender.finished.wait(60)
    flags = [f for _, f in request.sender.responses]
    assert flags[-1] == FINAL and all(f == 0 for f in flags[:-1])
    assert all(r is not None and r.error is None for r, _ in request.sender.responses)
    expected = LLM(model=str(tiny_model_dir("llama")), dtype="float32", device="cpu").generate(
        ["def main():"], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
    assert request.sender.text() == expected


def test_bad_input_gets_exactly_one_final_error(model) -> None:
    bad = generate_request("hi", {"top_p": 2})
    too_long = generate_request("hi", {"max_tokens": 5000})
    model.execute([bad, too_long])
    for request, field in ((bad, "top_p"), (too_long, "max_tokens")):
        assert request.sender.finished.wait(30)
        [(response, flags)] = request.sender.responses
        assert flags == FINAL and response.error.code == "INVALID_ARG" and field in response.error.message


def test_cancelled_request_ends_with_cancelled_and_frees_blocks(model) -> None:
    request = generate_request("while", {"temperature": 0, "max_tokens": 200, "ignore_eos": True})
    model.execute([request])
    deadline = time.monotonic() + 30
    while not request.sender.responses and time.monotonic() < deadline:
        time.sleep(0.005)
    request.sender.cancelled = True
    assert request.sender.finished.wait(30)
    last, flags = request.sender.responses[-1]
    assert flags == FINAL and last.error.code == "CANCELLED"
    assert len(request.sender.responses) < 200
    deadline = time.monotonic() + 10
    while model._engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not model._engine.has_unfinished_requests()
    assert wait_gauge_zero()


def wait_gauge_zero() -> bool:
    deadline = time.monotonic() + 10
    while MetricFamily.created["pagedllm:kv_blocks_used"].value != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return MetricFamily.created["pagedllm:kv_blocks_used"].value == 0


def test_finalize_ends_in_flight_requests_with_an_error(model) -> None:
    request = generate_request("import", {"temperature": 0, "max_tokens": 240, "ignore_eos": True})
    model.execute([request])
    deadline = time.monotonic() + 30
    while not request.sender.responses and time.monotonic() < deadline:
        time.sleep(0.005)
    model.finalize()
    assert request.sender.finished.is_set()
    last, flags = request.sender.responses[-1]
    assert flags == FINAL and last.error.code == "UNAVAILABLE" and "shutting down" in last.error.message
    later = generate_request("x", {"max_tokens": 2})
    model.execute([later])
    [(response, flags)] = later.sender.responses
    assert flags == FINAL and response.error is not None
