"""Wall-clock milestones of one request, as the engine loop measures them step by step (for metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.outputs import RequestOutput


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


@dataclass(slots=True)
class TimingAccount:
    """What the loop has seen of one in-flight request so far; ``close`` turns it into a ``RequestTiming``."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_token_steps: int = 0
    finish_reasons: dict[int, str | None] = field(default_factory=dict)  # by sample index

    def record(self, output: RequestOutput, now: float) -> None:
        """One step's output for the request, seen at ``now``."""
        self.num_prompt_tokens = len(output.prompt_token_ids)
        new_tokens = sum(len(delta.token_ids) for delta in output.outputs)
        if new_tokens:
            self.first_token = self.first_token if self.first_token is not None else now
            self.last_token = now
            self.num_output_tokens += new_tokens
            self.num_token_steps += 1
        for delta in output.outputs:
            self.finish_reasons[delta.index] = delta.finish_reason

    def close(self, request_id: str, num_samples: int, now: float) -> RequestTiming:
        reasons = tuple(self.finish_reasons.get(i) for i in range(num_samples))
        return RequestTiming(request_id, self.arrival, self.first_token, self.last_token, now,
                             self.num_prompt_tokens, self.num_output_tokens, self.num_token_steps, reasons)
