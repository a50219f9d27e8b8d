"""Drive one ``LLMEngine`` from a background thread so many callers can stream from it at once.

The engine is not thread-safe, so only the loop thread touches it: ``submit`` and
``abort`` queue commands that the loop applies between steps. ``submit`` waits for
the engine's verdict on the request, so bad input raises ``ValueError`` in the
caller and never reaches (or stops) the loop; ``submit_nowait`` returns that
verdict as a future instead. Outputs are delivered by calling the request's
``on_output`` on the loop thread, so callbacks must be quick (hand heavy work to
another thread).

Liveness: the thread never spins. With no work it sleeps until a submission, an
abort or ``stop``. With work that cannot move (a step that scheduled nothing: no
outputs and no change in the engine's progress counters, see ``engine_contract.progress``) it
sleeps the same way, waking every ``STALLED_RETRY_S`` only to read cancellation
flags and retry once. An engine whose ``step`` waits for work done elsewhere
(``EngineCoreProcess`` waits for its child's next step) is interrupted whenever a
command arrives (``engine_contract.Interruptible``), so a request reaches it as it
arrives rather than after the step in flight. A request whose ``SamplingParams.timeout`` has passed since
it arrived is aborted at the next step and ends with ``on_error(..., TIMEOUT)``.
Failures: a request the engine ended alone (``RequestOutput.error``) fails only that request; a step that raises fails every
in-flight request and the loop carries on; if the loop itself dies, ``healthy``
turns False, ``error`` says why, every caller gets ``on_error`` and new
submissions raise ``EngineUnavailable``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pagedllm.engine.engine_contract import STALLED_RETRY_S, EngineLike, Interruptible, IsCancelled, OnDeath, OnError, OnOutput, OnStep, progress
from pagedllm.core.errors import EngineBroken, EngineUnavailable, FailureKind
from pagedllm.engine.outputs import CompletionDelta, RequestOutput
from pagedllm.engine.request_timing import StepTimings, TimingAccount
from pagedllm.lora.request import LoRARequest
from pagedllm.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)



@dataclass(slots=True)
class _Tracked:
    request_id: str
    params: SamplingParams
    on_output: OnOutput
    on_error: OnError | None
    is_cancelled: IsCancelled | None
    timing: TimingAccount
    abort_sent: bool = False
    timed_out: bool = False


@dataclass(slots=True)
class _Submission:
    tracked: _Tracked
    prompt: str | list[int]
    verdict: Future[None]
    lora_request: LoRARequest | None = None


class EngineLoop:
    """Owns ``engine`` and steps it on a daemon thread; see the module docstring.

    ``on_step(stats, step_timings)`` runs on the loop thread after every step,
    once at start and whenever the engine goes idle, with ``engine.stats()``;
    metrics publishers hook in there. ``on_death(reason)`` runs on the dying thread
    if the loop dies, after every request has been failed (a server marks itself
    not ready there).
    """

    def __init__(self, engine: EngineLike, *, on_step: OnStep | None = None, on_death: OnDeath | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self._interruptible = engine if isinstance(engine, Interruptible) else None
        self._on_step = on_step
        self._on_death = on_death
        self._clock = clock
        self._wakeup = threading.Condition()
        self._submissions: list[_Submission] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._death: str | None = None  # why the thread died, once it has
        self._thread: threading.Thread | None = None
        self._in_flight: dict[str, _Tracked] = {}  # loop thread only
        self._admitting: list[_Submission] = []  # loop thread only: the batch being admitted
        self._progress: tuple[object, ...] | None = None  # loop thread only

    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine-loop", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """Started, not stopping, and the thread is alive."""
        return self.error is None

    @property
    def death(self) -> str | None:
        """Why the loop thread died, or None while it has not (a stop is not a death)."""
        return self._death

    @property
    def error(self) -> str | None:
        """Why the loop does not take requests (never started, stopping, or died), or None when it does."""
        if self._death is not None:
            return self._death
        if self._thread is None:
            return "engine loop is not running: not started"
        if self._stopping or not self._thread.is_alive():
            return "engine loop is not running: the model is shutting down"
        return None

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, on_output: OnOutput, *,
               on_error: OnError | None = None, is_cancelled: IsCancelled | None = None,
               lora_request: LoRARequest | None = None) -> None:
        """Hand a request to the engine; raises the engine's ``ValueError`` for bad input."""
        self.submit_nowait(request_id, prompt, params, on_output, on_error=on_error,
                           is_cancelled=is_cancelled, lora_request=lora_request).result()

    def submit_nowait(self, request_id: str, prompt: str | list[int], params: SamplingParams, on_output: OnOutput, *,
                      on_error: OnError | None = None, is_cancelled: IsCancelled | None = None,
                      lora_request: LoRARequest | None = None) -> Future[None]:
        """Queue a request; the future resolves once the engine accepted it or fails with its ``ValueError``.

        ``on_error(message, kind)`` (if given) replaces the final output when the request
        ends without finishing: the engine faulted on it, a step failed, or the loop
        stopped or died; without it such a request ends with an ``"abort"`` output (or
        the engine's output carrying ``error``). ``is_cancelled()`` is polled before
        every step; once it returns True the request is aborted. Raises
        ``EngineUnavailable`` when the loop does not take requests.
        """
        tracked = _Tracked(request_id, params, on_output, on_error, is_cancelled, TimingAccount(self._clock()))
        verdict: Future[None] = Future()
        with self._wakeup:
            reason = self.error
            if reason is not None:
                raise EngineUnavailable(reason)
            self._submissions.append(_Submission(tracked, prompt, verdict, lora_request))
            self._notify()
        return verdict

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op once it has finished); its final output has finish_reason ``"abort"``."""
        with self._wakeup:
            self._aborts.append(request_id)
            self._notify()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the thread; in-flight and queued requests end with an error (or ``"abort"``) callback.

        Returns whether the thread stopped within ``timeout_s``; it does not when a
        step is stuck, and then the caller must end its requests itself.
        """
        with self._wakeup:
            self._stopping = True
            self._notify()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("engine loop did not stop within %.1f s", timeout_s)
            return False
        return True

    def _notify(self) -> None:
        """With ``_wakeup`` held: new commands are queued."""
        self._wakeup.notify()
        if self._interruptible is not None:
            self._interruptible.interrupt()

    # ---- loop thread ----

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as error:  # a bug in the loop or the engine: callers must learn it, not hang
            log.exception("engine loop died")
            with self._wakeup:
                self._death = f"engine loop died: {type(error).__name__}: {error}"
                pending, self._submissions = self._admitting + self._submissions, []
            self._abandon([s for s in pending if not s.verdict.done()], self._death)
            if self._on_death is not None:
                try:
                    self._on_death(self._death)
                except Exception:
                    log.exception("on_death callback failed")
            return
        with self._wakeup:
            pending, self._submissions = self._submissions, []
        for submission in pending:
            submission.verdict.set_exception(EngineUnavailable("engine loop stopped before the request was admitted"))
        self._fail_all("the model is shutting down", FailureKind.UNAVAILABLE)

    def _serve(self) -> None:
        self._publish_stats(StepTimings())
        stalled = False
        idle_published = True
        while True:
            with self._wakeup:
                if stalled:
                    if not (self._stopping or self._submissions or self._aborts):
                        self._wakeup.wait(STALLED_RETRY_S)
                else:
                    while not (self._stopping or self._submissions or self._aborts
                               or self.engine.has_unfinished_requests()):
                        self._wakeup.wait()
                if self._stopping:
                    return
                self._admitting, self._submissions = self._submissions, []
                aborts, self._aborts = self._aborts, []
                if self._interruptible is not None:
                    # Under the lock: any interrupt left after this is for a command queued after this take.
                    self._interruptible.clear_interrupt()
            self._admit(self._admitting)
            self._admitting = []
            for request_id in aborts:
                self._abort(request_id)
            self._poll_cancellations()
            if self.engine.has_unfinished_requests():
                stalled = not self._step()
                idle_published = False
            elif not idle_published:
                stalled = False
                idle_published = True
                self._publish_stats(StepTimings())  # an idle server shows its freed blocks at once

    def _admit(self, submissions: list[_Submission]) -> None:
        for submission in submissions:
            tracked = submission.tracked
            if tracked.request_id in self._in_flight:
                submission.verdict.set_exception(ValueError(f"request_id {tracked.request_id!r} is already in flight"))
                continue
            try:
                if submission.lora_request is None:  # engines without LoRA take no such argument
                    self.engine.add_request(tracked.request_id, submission.prompt, tracked.params)
                else:
                    self.engine.add_request(tracked.request_id, submission.prompt, tracked.params,
                                            lora_request=submission.lora_request)
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
        now = self._clock()
        for tracked in list(self._in_flight.values()):
            if tracked.abort_sent:
                continue
            if tracked.params.timeout is not None and now - tracked.timing.arrival >= tracked.params.timeout:
                tracked.timed_out = True
                self._abort(tracked.request_id)
                continue
            if tracked.is_cancelled is None:
                continue
            try:
                cancelled = tracked.is_cancelled()
            except Exception:
                log.exception("is_cancelled callback failed; aborting request %s", tracked.request_id)
                cancelled = True
            if cancelled:
                self._abort(tracked.request_id)

    def _step(self) -> bool:
        """One engine step; returns whether it made progress (False: it scheduled nothing)."""
        before = self._progress
        try:
            outputs = self.engine.step()
        except EngineBroken:
            raise
        except Exception as error:
            log.exception("engine.step failed; failing every in-flight request")
            self._fail_all(f"engine step failed: {error}", FailureKind.ENGINE)
            return True
        now = self._clock()
        timings = StepTimings()
        for output in outputs:
            tracked = self._in_flight.get(output.request_id)
            if tracked is None:
                continue
            tracked.timing.record(output, now, timings)
            if output.finished:
                del self._in_flight[output.request_id]
                timings.finished.append(tracked.timing.close(tracked.request_id, tracked.params.n, now))
            if output.error is not None:
                kind = FailureKind.INVALID if output.invalid_input else FailureKind.REQUEST
                self._fail(tracked, output.error, kind, output)
            elif tracked.timed_out and output.finished:
                self._fail(tracked, f"request timed out after {tracked.params.timeout:g} s "
                           "(sampling_parameters.timeout)", FailureKind.TIMEOUT, output)
            else:
                self._deliver(tracked, output)
        self._publish_stats(timings)
        return bool(outputs) or self._progress != before

    def _deliver(self, tracked: _Tracked, output: RequestOutput) -> None:
        try:
            tracked.on_output(output)
        except Exception:
            log.exception("on_output callback failed for request %s; aborting it", tracked.request_id)
            if not output.finished:
                self._abort(tracked.request_id)

    def _fail(self, tracked: _Tracked, message: str, kind: FailureKind, output: RequestOutput | None = None) -> None:
        """End one request with ``on_error``, or (without one) with ``output`` or an ``"abort"`` output."""
        if tracked.on_error is None:
            self._deliver(tracked, output if output is not None else _abort_output(tracked))
            return
        try:
            tracked.on_error(message, kind)
        except Exception:
            log.exception("on_error callback failed for request %s", tracked.request_id)

    def _publish_stats(self, timings: StepTimings) -> None:
        try:
            stats = self.engine.stats()
        except Exception:
            log.exception("engine.stats failed")
            return
        self._progress = progress(stats)
        if self._on_step is None:
            return
        try:
            self._on_step(stats, timings)
        except Exception:
            log.exception("on_step callback failed")

    def _fail_all(self, message: str, kind: FailureKind) -> None:
        """End every in-flight request with an error, and free its engine state as far as possible."""
        failed, self._in_flight = list(self._in_flight.values()), {}
        now = self._clock()
        for tracked in failed:
            try:
                self.engine.abort_request(tracked.request_id)
            except Exception:
                log.exception("engine.abort_request failed for %s", tracked.request_id)
            self._fail(tracked, message, kind)
        # Let the engine release the aborted requests' blocks; their outputs are no longer wanted.
        for _ in range(4):
            if not self.engine.has_unfinished_requests():
                break
            try:
                self.engine.step()
            except Exception:
                log.exception("engine.step failed while draining aborted requests")
                break
        self._publish_stats(StepTimings([tracked.timing.close(tracked.request_id, tracked.params.n, now)
                                         for tracked in failed]))

    def _abandon(self, pending: list[_Submission], reason: str) -> None:
        """After the loop died: fail everything without touching the engine, whose state is suspect."""
        for submission in pending:
            submission.verdict.set_exception(EngineUnavailable(reason))
        failed, self._in_flight = list(self._in_flight.values()), {}
        for tracked in failed:
            self._fail(tracked, reason, FailureKind.UNAVAILABLE)


def _abort_output(tracked: _Tracked) -> RequestOutput:
    deltas = tuple(CompletionDelta(index=i, text="", token_ids=(), cumulative_logprob=0.0, logprobs=None,
                                   finish_reason="abort") for i in range(tracked.params.n)
                   if tracked.timing.finish_reasons.get(i) is None)
    return RequestOutput(request_id=tracked.request_id, prompt=None, prompt_token_ids=(), outputs=deltas, finished=True)
