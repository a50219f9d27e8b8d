"""TritonPythonModel when things go wrong: a request the engine faults on, a dead loop, a hung step at finalize.

Driven in-process through the stand-in for triton_python_backend_utils of test_triton_model.py.
"""
from __future__ import annotations

import threading
import time

import pytest

from test_triton_model import FINAL, generate_request, model  # noqa: F401  (model is a fixture)

from pagedllm.engine.outputs import RequestOutput


def wait_for_response(request, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not request.sender.responses and time.monotonic() < deadline:
        time.sleep(0.005)
    assert request.sender.responses, "no response"


class InjectedFault(BaseException):
    """Escapes every ``except Exception``: the loop thread dies of it."""


def test_a_request_the_engine_faulted_on_ends_alone_with_internal(model, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = generate_request("class", {"temperature": 0, "max_tokens": 50, "ignore_eos": True})
    bystander = generate_request("def main():", {"temperature": 0, "max_tokens": 20, "ignore_eos": True})
    real_step = model._engine.step

    def step() -> list[RequestOutput]:
        outputs = real_step()
        faulted = [o for o in outputs if o.prompt == "class" and not o.finished]
        if faulted:  # as the engine reports a request it ended alone (RequestOutput.error)
            model._engine.abort_request(faulted[0].request_id)
            outputs = [o for o in outputs if o not in faulted]
            outputs.append(RequestOutput(faulted[0].request_id, None, (), (), True, error="kernel fault in row 3"))
        return outputs

    monkeypatch.setattr(model._engine, "step", step)
    model.execute([victim, bystander])
    assert victim.sender.finished.wait(30) and bystander.sender.finished.wait(60)
    last, flags = victim.sender.responses[-1]
    assert flags == FINAL and last.error.code == "INTERNAL" and last.error.message == "kernel fault in row 3"
    assert all(r is None or r.error is None for r, _ in bystander.sender.responses)
    assert bystander.sender.responses[-1][1] == FINAL


def test_a_dead_loop_fails_in_flight_requests_unloads_the_model_and_refuses_new_ones(
        model, monkeypatch: pytest.MonkeyPatch) -> None:
    import triton_python_backend_utils as pb_utils

    unloaded: list[str] = []
    monkeypatch.setattr(pb_utils, "unload_model", unloaded.append, raising=False)
    running = generate_request("while", {"temperature": 0, "max_tokens": 200, "ignore_eos": True})
    model.execute([running])
    wait_for_response(running)

    def corrupted() -> bool:
        raise InjectedFault("engine state corrupted")

    monkeypatch.setattr(model._engine, "has_unfinished_requests", corrupted)
    assert running.sender.finished.wait(30)
    last, flags = running.sender.responses[-1]
    assert flags == FINAL and last.error.code == "UNAVAILABLE" and "engine state corrupted" in last.error.message
    deadline = time.monotonic() + 10
    while not unloaded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert unloaded == ["llm"]  # Triton turns /v2/models/llm/ready false once it has unloaded the model
    later = generate_request("x", {"max_tokens": 2})
    model.execute([later])
    assert later.sender.finished.wait(10)
    [(response, flags)] = later.sender.responses
    assert flags == FINAL and response.error.code == "UNAVAILABLE"
    assert "engine loop died" in response.error.message and "engine state corrupted" in response.error.message


def test_finalize_returns_within_its_budget_while_a_step_hangs(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """finalize gives up on the hung step after its budget: it returns while that step is still inside ``step()``
    (the step is let go only afterwards). No duration is asserted; the time is printed."""
    import pagedllm.serving.triton.model as module

    monkeypatch.setattr(module, "FINALIZE_BUDGET_S", 2.0)
    release = threading.Event()
    real_step = model._engine.step
    hang, inside, left = threading.Event(), threading.Event(), threading.Event()

    def step() -> list[RequestOutput]:
        if hang.is_set():
            inside.set()
            release.wait(120)
            left.set()
        return real_step()

    monkeypatch.setattr(model._engine, "step", step)
    requests = [generate_request(f"import x{i}", {"temperature": 0, "max_tokens": 200, "ignore_eos": True})
                for i in range(3)]
    model.execute(requests)
    for request in requests:
        wait_for_response(request)
    hang.set()
    assert inside.wait(60), "the engine loop never entered a step"
    started = time.monotonic()
    finalizing = threading.Thread(target=model.finalize, daemon=True)
    try:
        finalizing.start()
        finalizing.join(100)  # a hang guard only: finalize must not wait for the step, which hangs for 120 s
        returned_while_hung = not finalizing.is_alive() and not left.is_set()
    finally:
        release.set()
    print(f"\nfinalize returned after {time.monotonic() - started:.1f} s (budget 2 s) while the step hung")
    assert returned_while_hung, "finalize waited for the hung step instead of giving up after its budget"
    for request in requests:
        assert request.sender.finished.is_set()
        last, flags = request.sender.responses[-1]
        assert flags == FINAL and last.error.code == "UNAVAILABLE" and "shutting down" in last.error.message
