"""Wall-clock milestones of one finished request, as the engine loop measured them (for metrics)."""
from __future__ import annotations

from dataclasses import dataclass


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
