"""What the engine hands back: per-step deltas, and their accumulation into finished results."""
from __future__ import annotations

from dataclasses import dataclass, field


# The per-step records are not frozen: one is built per token (or request) per step, and a frozen
# __init__ costs several times more. Nothing mutates them once built.
@dataclass(slots=True)
class CompletionDelta:
    """What one of a request's ``n`` samples produced in one engine step."""

    index: int
    text: str  # new text since the previous delta (may be "" while bytes are incomplete)
    token_ids: tuple[int, ...]  # new token ids
    # Of every token sampled so far; None unless the request set logprobs (as in vLLM) or is a beam search.
    cumulative_logprob: float | None
    logprobs: tuple[dict[int, float], ...] | None  # per new token: top-k and chosen id -> logprob
    finish_reason: str | None  # "stop" | "length" | "abort" once this sample is done
    score: float | None = None  # beam search: cumulative_logprob after the length penalty


@dataclass(slots=True)
class RequestOutput:
    """One engine step's news for one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionDelta, ...]  # only the samples that changed this step
    finished: bool  # every sample is done; no more outputs will follow
    # Set (with finished=True) when the engine ended this request because it faulted, alone:
    # the other requests of the batch carry on. Says why, for the client.
    error: str | None = None
    # With SamplingParams.prompt_logprobs, once, in the output that follows the prompt's last chunk:
    # None for the first prompt token, then per token its id and the top ids -> logprob.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With ``error``: the request's own input was at fault (a constraint that does not compile), not the engine.
    invalid_input: bool = False


@dataclass(slots=True)
class CompletionOutput:
    """One sample's whole output, accumulated from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None  # None unless the request set logprobs or is a beam search
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    score: float | None = None  # beam search only: the hypothesis' score after the length penalty

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.cumulative_logprob = delta.cumulative_logprob
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if delta.score is not None:
            self.score = delta.score


@dataclass(slots=True)
class FinalOutput:
    """A request's complete result, as ``LLM.generate`` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def start(cls, first: RequestOutput, n: int) -> FinalOutput:
        return cls(first.request_id, first.prompt, list(first.prompt_token_ids), [CompletionOutput(i) for i in range(n)])

    def add(self, step: RequestOutput) -> None:
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = step.prompt_logprobs
        for delta in step.outputs:
            self.outputs[delta.index].add(delta)
        self.finished = step.finished
