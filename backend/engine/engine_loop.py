"""Drive one ``LLMEngine`` from a background thread so many callers can stream from it at once.

The engine is not thread-safe, so only the loop thread touches it: ``submit`` and
``abort`` queue commands that the loop applies between steps. ``submit`` waits for
the engine's verdict on the request, so bad input raises ``ValueError`` in the
caller and never reaches (or stops) the loop; ``submit_nowait`` returns that
verdict as a future instead. Outputs are delivered by calling the request's
``on_output`` on the loop thread, so callbacks must be quick (hand heavy work to
another thread). When idle the thread sleeps on a condition variable.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.engine.outputs import CompletionDelta, RequestOutput
from pagedllm.sampling_params import SamplingParams

log = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]
OnError = Callable[[str], None]
IsCancelled = Callable[[], bool]


class EngineLike(Protocol):
    """What the loop needs from ``pagedllm.engine.LLMEngine`` (fakes in tests follow it too)."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> object: ...


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Wall-clock milestones of one finished request (``time.monotonic`` seconds)."""

    request_id: str
    arrival: float
    first_token: float | None  # None when no token was produced (aborted early)
    last_token: float | None
    finished: float
    num_prompt_tokens: int
    num_output_tokens: int  # over all samples
    num_token_steps: int  # engine steps that produced tokens for this request
    finish_reasons: tuple[str | None, ...]

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between token-producing steps after the first; None with fewer than two."""
        if self.first_token is None or self.last_token is None or self.num_token_steps < 2:
            return None
        return (self.last_token - self.first_token) / (self.num_token_steps - 1)

    @property
    def e2e_latency(self) -> float:
        return self.finished - self.arrival


OnStep = Callable[[object, Sequence[RequestTiming]], None]


@dataclass(slots=True)
class _Tracked:
    request_id: str
    params: SamplingParams
    on_output: OnOutput
    on_error: OnError | None
    is_cancelled: IsCancelled | None
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_token_steps: int = 0
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    abort_sent: bool = False


@dataclass(slots=True)
class _Submission:
    tracked: _Tracked
    prompt: str | list[int]
    verdict: Future[None]


class EngineLoop:
    """Owns ``engine`` and steps it on a daemon thread; see the module docstring.

    ``on_step(stats, finished_timings)`` runs on the loop thread after every step
    (and once at start) with ``engine.stats()``; metrics publishers hook in there.
    """

    def __init__(self, engine: EngineLike, *, on_step: OnStep | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self._on_step = on_step
        self._clock = clock
        self._wakeup = threading.Condition()
        self._submissions: list[_Submission] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._in_flight: dict[str, _Tracked] = {}  # loop thread only

    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine-loop", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, on_output: OnOutput, *,
               on_error: OnError | None = None, is_cancelled: IsCancelled | None = None) -> None:
        """Hand a request to the engine; raises the engine's ``ValueError`` for bad input."""
        self.submit_nowait(request_id, prompt, params, on_output, on_error=on_error,
                           is_cancelled=is_cancelled).result()

    def submit_nowait(self, request_id: str, prompt: str | list[int], params: SamplingParams, on_output: OnOutput, *,
                      on_error: OnError | None = None, is_cancelled: IsCancelled | None = None) -> Future[None]:
        """Queue a request; the future resolves once the engine accepted it or fails with its ``ValueError``.

        ``on_error(message)`` (if given) replaces the final ``"abort"`` output when the request
        ends because the loop stopped or the engine failed. ``is_cancelled()`` is polled before
        every step; once it returns True the request is aborted.
        """
        tracked = _Tracked(request_id, params, on_output, on_error, is_cancelled, arrival=self._clock())
        verdict: Future[None] = Future()
        with self._wakeup:
            if self._stopping or not self.running:
                raise RuntimeError("engine loop is not running")
            self._submissions.append(_Submission(tracked, prompt, verdict))
            self._wakeup.notify()
        return verdict

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op once it has finished); its final output has finish_reason ``"abort"``."""
        with self._wakeup:
            self._aborts.append(request_id)
            self._wakeup.notify()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread; in-flight and queued requests end with an error (or ``"abort"``) callback."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.0f s", timeout_s)

    # ---- loop thread ----

    def _run(self) -> None:
        self._publish_stats([])
        while True:
            with self._wakeup:
                while not (self._stopping or self._submissions or self._aborts
                           or self.engine.has_unfinished_requests()):
                    self._wakeup.wait()
                if self._stopping:
                    break
                submissions, self._submissions = self._submissions, []
                aborts, self._aborts = self._aborts, []
            self._admit(submissions)
            for request_id in aborts:
                self._abort(request_id)
            self._poll_cancellations()
            if self.engine.has_unfinished_requests():
                self._step()
        self._shutdown()

    def _admit(self, submissions: list[_Submission]) -> None:
        for submission in submissions:
            tracked = submission.tracked
            if tracked.request_id in self._in_flight:
                submission.verdict.set_exception(ValueError(f"request_id {tracked.request_id!r} is already in flight"))
                continue
            try:
                self.engine.add_request(tracked.request_id, submission.prompt, tracked.params)
            except ValueError as error:
                submission.verdict.set_exception(error)
                continue
            except Exception as error:  # an engine bug must not kill the loop
                log.exception("engine.add_request failed")
                submission.verdict.set_exception(RuntimeError(f"engine failed to accept the request: {error}"))
                continue
            self._in_flight[tracked.request_id] = tracked
            submission.verdict.set_result(None)

    def _abort(self, request_id: str) -> None:
        tracked = self._in_flight.get(request_id)
        if tracked is not None and not tracked.abort_sent:
            tracked.abort_sent = True
            self.engine.abort_request(request_id)

    def _poll_cancellations(self) -> None:
        for tracked in list(self._in_flight.values()):
            if tracked.is_cancelled is None or tracked.abort_sent:
                continue
            try:
                cancelled = tracked.is_cancelled()
            except Exception:
                log.exception("is_cancelled callback failed; aborting request %s", tracked.request_id)
                cancelled = True
            if cancelled:
                self._abort(tracked.request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            log.exception("engine.step failed; failing every in-flight request")
            self._fail_all(f"engine step failed: {error}")
            return
        now = self._clock()
        finished: list[RequestTiming] = []
        for output in outputs:
            tracked = self._in_flight.get(output.request_id)
            if tracked is None:
                continue
            self._account(tracked, output, now)
            if output.finished:
                del self._in_flight[output.request_id]
                finished.append(self._timing(tracked, now))
            self._deliver(tracked, output)
        self._publish_stats(finished)

    def _account(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        tracked.num_prompt_tokens = len(output.prompt_token_ids)
        new_tokens = sum(len(delta.token_ids) for delta in output.outputs)
        if new_tokens:
            tracked.first_token = tracked.first_token if tracked.first_token is not None else now
            tracked.last_token = now
            tracked.num_output_tokens += new_tokens
            tracked.num_token_steps += 1
        for delta in output.outputs:
            tracked.finish_reasons[delta.index] = delta.finish_reason

    def _timing(self, tracked: _Tracked, now: float) -> RequestTiming:
        reasons = tuple(tracked.finish_reasons.get(i) for i in range(tracked.params.n))
        return RequestTiming(tracked.request_id, tracked.arrival, tracked.first_token, tracked.last_token, now,
                             tracked.num_prompt_tokens, tracked.num_output_tokens, tracked.num_token_steps, reasons)

    def _deliver(self, tracked: _Tracked, output: RequestOutput) -> None:
        try:
            tracked.on_output(output)
        except Exception:
            log.exception("on_output callback failed for request %s; aborting it", tracked.request_id)
            if not output.finished:
                self._abort(tracked.request_id)

    def _publish_stats(self, finished: Sequence[RequestTiming]) -> None:
        if self._on_step is None:
            return
        try:
            self._on_step(self.engine.stats(), finished)
        except Exception:
            log.exception("on_step callback failed")

    def _fail_all(self, message: str) -> None:
        """End every in-flight request with an error, and free its engine state as far as possible."""
        failed, self._in_flight = list(self._in_flight.values()), {}
        now = self._clock()
        for tracked in failed:
            try:
                self.engine.abort_request(tracked.request_id)
            except Exception:
                log.exception("engine.abort_request failed for %s", tracked.request_id)
            if tracked.on_error is not None:
                try:
                    tracked.on_error(message)
                except Exception:
                    log.exception("on_error callback failed for request %s", tracked.request_id)
            else:
                self._deliver(tracked, _abort_output(tracked))
        # Let the engine release the aborted requests' blocks; their outputs are no longer wanted.
        for _ in range(4):
            if not self.engine.has_unfinished_requests():
                break
            try:
                self.engine.step()
            except Exception:
                log.exception("engine.step failed while draining aborted requests")
                break
        self._publish_stats([self._timing(tracked, now) for tracked in failed])

    def _shutdown(self) -> None:
        with self._wakeup:
            pending, self._submissions = self._submissions, []
        for submission in pending:
            submission.verdict.set_exception(RuntimeError("engine loop stopped before the request was admitted"))
        self._fail_all("the model is shutting down")


def _abort_output(tracked: _Tracked) -> RequestOutput:
    deltas = tuple(CompletionDelta(i, "", (), 0.0, None, "abort") for i in range(tracked.params.n)
                   if tracked.finish_reasons.get(i) is None)
    return RequestOutput(tracked.request_id, None, (), deltas, finished=True)
