"""Ordered, per-request responses from one sender thread, merging a request's backlog."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pagedllm.serving.triton.response_dispatcher import Data, Failure, ResponseDispatcher


def text(value: str) -> dict[str, np.ndarray]:
    return {"text_output": np.array([value.encode()], dtype=np.object_),
            "num_output_tokens": np.array([1], dtype=np.uint32)}


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, bool]] = []  # (target, text or error, final)
        self.gate = threading.Event()
        self.gate.set()

    def send_data(self, target: str, tensors, final: bool) -> None:
        self.gate.wait(5)
        value = "" if tensors is None else b"|".join(tensors["text_output"]).decode()
        count = 0 if tensors is None else int(tensors["num_output_tokens"][0])
        self.sent.append((target, f"{value}#{count}", final))

    def send_failure(self, target: str, message: str, code: str) -> None:
        self.sent.append((target, f"{code}:{message}", True))


def test_each_push_is_sent_in_order_when_sending_keeps_up() -> None:
    recorder = Recorder()
    dispatcher = ResponseDispatcher(recorder.send_data, recorder.send_failure)
    dispatcher.push("a", "A", Data(text("x"), False))
    dispatcher.close()
    assert recorder.sent == [("A", "x#1", False)]


def test_a_backlog_is_merged_per_request_and_order_is_kept() -> None:
    recorder = Recorder()
    recorder.gate.clear()  # the sender is stuck on the first response while more arrive
    dispatcher = ResponseDispatcher(recorder.send_data, recorder.send_failure)
    dispatcher.push("a", "A", Data(text("a1"), False))
    while dispatcher._outboxes:  # wait until the first one is being sent
        time.sleep(0.001)
    for piece in ("a2", "a3"):
        dispatcher.push("a", "A", Data(text(piece), False))
    dispatcher.push("b", "B", Data(text("b1"), False))
    dispatcher.push("a", "A", Data(None, True))
    dispatcher.push("b", "B", Failure("request was cancelled", "CANCELLED"))
    recorder.gate.set()
    dispatcher.close()
    assert recorder.sent == [
        ("A", "a1#1", False),
        ("A", "a2a3#2", True),
        ("B", "b1#1", False),
        ("B", "CANCELLED:request was cancelled", True),
    ]


def test_push_after_close_raises() -> None:
    dispatcher = ResponseDispatcher(Recorder().send_data, Recorder().send_failure)
    dispatcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        dispatcher.push("a", "A", Data(None, True))


def test_a_failing_send_does_not_stop_the_thread() -> None:
    sent = []

    def flaky(target, tensors, final) -> None:
        if target == "bad":
            raise RuntimeError("client gone")
        sent.append(target)

    dispatcher = ResponseDispatcher(flaky, lambda *args: None)
    dispatcher.push("1", "bad", Data(text("x"), True))
    dispatcher.push("2", "good", Data(text("y"), True))
    dispatcher.close()
    assert sent == ["good"]


def test_inline_items_are_sent_on_the_callers_thread_only_when_the_dispatcher_is_idle() -> None:
    threads: list[str] = []
    release = threading.Event()

    def send_data(target: str, tensors: object, final: bool) -> None:
        threads.append(f"{target}:{threading.current_thread().name}")
        if target == "slow":
            release.wait(5)

    dispatcher = ResponseDispatcher(send_data, lambda *args: None)
    dispatcher.push("a", "A", Data(text("a1"), False), inline=True)
    dispatcher.push("s", "slow", Data(text("s1"), False))  # keeps the sender thread busy
    while dispatcher._outboxes:
        time.sleep(0.001)
    dispatcher.push("a", "A", Data(text("a2"), False), inline=True)  # busy: queued behind it instead
    release.set()
    dispatcher.close()
    me = threading.current_thread().name
    assert threads == [f"A:{me}", "slow:pagedllm-sender", "A:pagedllm-sender"]


def test_a_first_response_goes_ahead_of_the_requests_already_waiting() -> None:
    recorder = Recorder()
    recorder.gate.clear()  # the sender is stuck on one response while more arrive
    dispatcher = ResponseDispatcher(recorder.send_data, recorder.send_failure)
    dispatcher.push("a", "A", Data(text("a1"), False))
    while dispatcher._outboxes:
        time.sleep(0.001)
    dispatcher.push("a", "A", Data(text("a2"), False))
    dispatcher.push("b", "B", Data(text("b2"), False))
    dispatcher.push("c", "C", Data(text("c1"), False), first=True)
    recorder.gate.set()
    dispatcher.close()
    assert [target for target, _, _ in recorder.sent] == ["A", "C", "A", "B"]
