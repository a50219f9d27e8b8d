"""What ``EngineLoop`` needs from an engine and what it tells its callers.

``LLMEngine`` (in-process), ``EngineCoreProcess`` (the engine in a child
process) and the tests' fakes all follow ``EngineLike``; servers read
``FailureKind`` and ``EngineUnavailable`` to pick a response code.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.request_timing import StepTimings
from pagedllm.core.errors import FailureKind
from pagedllm.core.sampling_params import SamplingParams


# How long a loop whose engine scheduled nothing sleeps before it looks at cancellations again.
STALLED_RETRY_S = 0.5
# Engine counters that change whenever a step computes anything (blocks move with every
# prefill chunk); prefix-cache lookup counters are left out: a blocked queue head may
# be looked up again by a step that schedules nothing.
_PROGRESS_FIELDS = ("num_blocks_used", "num_blocks_free", "num_running", "num_waiting", "num_preemptions",
                    "prompt_tokens_total", "generation_tokens_total")


def progress(stats: object) -> tuple[object, ...]:
    """The engine's progress counters: a step that returned no output and left them equal scheduled nothing."""
    return tuple(getattr(stats, name, None) for name in _PROGRESS_FIELDS)


OnOutput = Callable[[RequestOutput], None]
OnError = Callable[[str, FailureKind], None]
IsCancelled = Callable[[], bool]


class EngineLike(Protocol):
    """What the loop needs from ``pagedllm.engine.LLMEngine`` (fakes in tests follow it too)."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> object: ...


@runtime_checkable
class Interruptible(Protocol):
    """An engine whose ``step`` waits on something outside the loop (``EngineCoreProcess`` waits for its
    child's next step): the loop interrupts that wait when it has commands, so a request reaches the
    engine as it arrives rather than after the step in progress."""

    def interrupt(self) -> None:
        """Thread-safe: make the current or next ``step`` return ``[]`` at once if it would wait."""
        ...

    def clear_interrupt(self) -> None:
        """Forget interrupts; the loop calls this as it takes the commands they were for."""
        ...


OnStep = Callable[[object, StepTimings], None]
OnDeath = Callable[[str], None]
