"""Wall-clock milestones and token counts of requests, as the engine loop sees them step by step (for metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Wall-clock milestones of one finished request (``time.monotonic`` seconds) and what it produced."""

    request_id: str
    arrival: float
    first_token: float | None  # None when no token was produced (aborted early)
    last_token: float | None
    finished: float
    num_prompt_tokens: int
    num_output_tokens: int  # over all samples (beam search: of the hypotheses returned)
    num_token_steps: int  # engine steps that produced tokens for this request
    finish_reasons: tuple[str | None, ...]
    n: int = 1  # the request's n: samples (or, with beam search, hypotheses) it asked for

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_latency(self) -> float:
        return self.finished - self.arrival


@dataclass(slots=True)
class StepTimings:
    """What one engine step tells the metrics: the token latencies it saw, as they happened, and who finished.

    The events vLLM observes: a request's time to first token at the step that produced it, and
    each later token-producing step's gap since the request's previous one (inter-token latency).
    """

    finished: list[RequestTiming] = field(default_factory=list)
    first_token_latencies: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)


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

    def record(self, output: RequestOutput, now: float, step: StepTimings) -> None:
        """One step's output for the request, seen at ``now``; its token latency goes into ``step``."""
        self.num_prompt_tokens = len(output.prompt_token_ids)
        new_tokens = sum(len(delta.token_ids) for delta in output.outputs)
        if new_tokens:
            if self.last_token is None:
                self.first_token = now
                step.first_token_latencies.append(now - self.arrival)
            else:
                step.inter_token_latencies.append(now - self.last_token)
            self.last_token = now
            self.num_output_tokens += new_tokens
            self.num_token_steps += 1
        for delta in output.outputs:
            self.finish_reasons[delta.index] = delta.finish_reason

    def close(self, request_id: str, num_samples: int, now: float) -> RequestTiming:
        reasons = tuple(self.finish_reasons.get(i) for i in range(num_samples))
        return RequestTiming(request_id, self.arrival, self.first_token, self.last_token, now,
                             self.num_prompt_tokens, self.num_output_tokens, self.num_token_steps, reasons,
                             num_samples)
