"""The cancellation watcher turns slow per-request probes into cheap flags."""
from __future__ import annotations

import threading
import time

import pytest

from pagedllm.serving.triton.cancellation import MAX_INTERVAL_S, MAX_PROBE_SHARE, CancellationWatcher, pause_after


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_flag_turns_true_after_the_probe_does_and_only_for_that_request() -> None:
    watcher = CancellationWatcher(interval_s=0.001)
    try:
        cancel_a = threading.Event()
        flag_a = watcher.register("a", cancel_a.is_set)
        flag_b = watcher.register("b", lambda: False)
        assert not flag_a() and not flag_b()
        cancel_a.set()
        assert wait_until(flag_a)
        assert not flag_b()
    finally:
        watcher.close()


def test_a_cancelled_request_is_not_probed_again_and_unregister_forgets_it() -> None:
    watcher = CancellationWatcher(interval_s=0.001)
    calls = []
    try:
        flag = watcher.register("a", lambda: calls.append(1) or True)
        assert wait_until(flag)
        seen = len(calls)
        time.sleep(0.05)
        assert len(calls) == seen == 1
        watcher.unregister("a")
        assert not flag()
    finally:
        watcher.close()


def test_a_failing_probe_counts_as_cancelled() -> None:
    watcher = CancellationWatcher(interval_s=0.001)

    def broken() -> bool:
        raise RuntimeError("sender gone")

    try:
        assert wait_until(watcher.register("a", broken))
    finally:
        watcher.close()


def test_idle_watcher_does_not_probe_and_closes_promptly() -> None:
    watcher = CancellationWatcher(interval_s=0.001)
    calls = []
    watcher.register("a", lambda: calls.append(1) or False)
    assert wait_until(lambda: len(calls) > 0)
    watcher.unregister("a")
    time.sleep(0.02)
    seen = len(calls)
    time.sleep(0.05)
    assert len(calls) == seen
    watcher.close()
    assert not watcher._thread.is_alive()


def test_no_probe_runs_once_unregister_returns() -> None:
    """A probe touches Triton's response factory, which the final response frees:
    after unregister() (called before that send) no probe may still be running."""
    watcher = CancellationWatcher(interval_s=0.0)
    probing = threading.Event()
    state = {"unregistered": False, "late_probe": False}

    def slow_probe() -> bool:
        probing.set()
        time.sleep(0.05)
        state["late_probe"] |= state["unregistered"]
        return False

    try:
        watcher.register("a", slow_probe)
        assert probing.wait(5)
        watcher.unregister("a")
        state["unregistered"] = True
        time.sleep(0.1)
        assert not state["late_probe"], "a probe was still running after unregister() returned"
    finally:
        watcher.close()


def test_the_pause_between_sweeps_grows_with_the_sweep_so_probing_stays_a_small_share() -> None:
    assert pause_after(0.0001, 0.02) == 0.02  # few requests: the configured interval
    assert pause_after(0.0016, 0.02) == pytest.approx(0.0016 / MAX_PROBE_SHARE)  # 64 streams: ~80 ms
    assert pause_after(0.5, 0.02) == MAX_INTERVAL_S  # a cancellation is still seen within a second
    assert pause_after(0.5, 2.0) == 2.0  # a longer configured interval wins
