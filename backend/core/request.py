"""A user's request and the sequences (one per sample) that the scheduler runs."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """One sample's token stream: the unit the scheduler batches and the KV cache stores.

    There is no prefill or decode phase: each step computes some of the tokens in
    ``token_ids[num_computed_tokens:]``, so chunked prefill and recompute after
    preemption are the same code path as decoding.
    """

    seq_id: int
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full, computed blocks
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_fork(self) -> bool:
        """The request's first sample, about to sample its first token, with siblings still to spawn."""
        return self.request.params.n > len(self.request.sequences) and self.num_output_tokens == 0


@dataclass(eq=False, slots=True)
class Request:
    """What a client asked for: one prompt, ``params.n`` samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(s.is_finished for s in self.sequences)
