"""Watch in-flight Triton requests for client cancellation without slowing the engine loop.

Asking Triton whether a request was cancelled (``response_sender.is_cancelled()``) is
an IPC round trip to the server (measured: RESULTS.md, "Figures behind the code's choices");
doing it for every in-flight request before every engine step would add milliseconds per step
at high concurrency. A watcher thread asks instead, sweeping all registered requests at
most every ``interval_s``, and the engine loop reads the answers as flags each step.

A sweep's cost grows with the requests in flight (at high concurrency, sweeping at a fixed
interval took a noticeable share of a core that the server's other threads share), so the
pause after a sweep grows with it too: probing stays under ``MAX_PROBE_SHARE`` of the watcher's time,
and a cancellation is noticed within ``MAX_INTERVAL_S`` at any load.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Probe = Callable[[], bool]
MAX_PROBE_SHARE = 0.02
MAX_INTERVAL_S = 1.0


def pause_after(sweep_s: float, interval_s: float) -> float:
    """Seconds to wait after a sweep that took ``sweep_s``."""
    return min(max(interval_s, sweep_s / MAX_PROBE_SHARE), max(interval_s, MAX_INTERVAL_S))


class CancellationWatcher:
    """``register(key, probe)`` returns a cheap ``() -> bool`` that turns True once ``probe()`` did."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self._interval_s = interval_s
        self._probes: dict[str, Probe] = {}
        self._cancelled: set[str] = set()
        self._changed = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-cancellation", daemon=True)
        self._thread.start()

    def register(self, key: str, probe: Probe) -> Callable[[], bool]:
        with self._changed:
            self._probes[key] = probe
            self._changed.notify()
        return lambda: key in self._cancelled

    def unregister(self, key: str) -> None:
        """Stop probing ``key``; call it before sending the request's final response."""
        with self._changed:
            self._probes.pop(key, None)
            self._cancelled.discard(key)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._probes and not self._closing:
                    self._changed.wait()
                if self._closing:
                    return
                # Probe while holding the lock: once unregister() returns, no probe of that
                # request is running or will start, so the caller may send its FINAL
                # response, which frees the Triton response factory the probe reads.
                started = time.perf_counter()
                for key, probe in list(self._probes.items()):
                    if key not in self._cancelled and self._probe(key, probe):
                        self._cancelled.add(key)
                pause = pause_after(time.perf_counter() - started, self._interval_s)
                self._changed.wait_for(lambda: self._closing, timeout=pause)

    @staticmethod
    def _probe(key: str, probe: Probe) -> bool:
        try:
            return probe()
        except Exception:
            log.exception("cancellation probe failed for %s; treating it as cancelled", key)
            return True
