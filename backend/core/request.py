"""A user's request and the sequences (one per sample) that the scheduler runs.

Plain bookkeeping only: token ids, block tables, status. What turns tokens into
text (detokenizers) and what draws them (generators) belongs to the engine, so
the scheduler's unit stays small and torch-free.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from pagedllm.core.beam_search import BeamSearch
from pagedllm.core.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SampleStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Looking a member up on its enum class costs ~0.15 µs in Python 3.11; these checks run for every
# sequence several times a step.
_FINISHED = SampleStatus.FINISHED


@dataclass(eq=False, slots=True)
class Sample:
    """One sample's token stream: the unit the scheduler batches and the KV cache stores.

    There is no prefill or decode phase: each step computes some of the tokens in
    ``token_ids[num_computed_tokens:]``, so chunked prefill and recompute after
    preemption are the same code path as decoding.
    """

    seq_id: int
    request: Request
    index: int  # which of the request's n samples (beams: order of creation)
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained keys of its full, computed blocks
    status: SampleStatus = SampleStatus.WAITING
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    # Speculative decoding: tokens proposed to follow ``token_ids``, verified at its next step. Never part of
    # ``token_ids`` (nor of any block's hash) until the target model accepts them; dropped whenever
    # ``token_ids`` changes or the sequence is preempted.
    spec_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0  # times preempted: a re-admission is not a new prefix-cache query (vLLM's rule)

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
        return self.status is _FINISHED

    @property
    def pending_forks(self) -> int:
        """Siblings this sequence will spawn when it samples its first token (``n > 1``, or the other beams)."""
        request = self.request
        if len(self.token_ids) > self.num_prompt_tokens or self is not request.sequences[0]:
            return 0
        return request.fan_out - len(request.sequences)


@dataclass(eq=False, slots=True)
class Request:
    """What a client asked for: one prompt, ``params.n`` samples, or a beam search over ``params.beam_width`` beams."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # The LoRA adapter it runs through (its lora_int_id); 0 is the base model. Part of its KV blocks' keys.
    lora_int_id: int = 0
    lora_name: str | None = None  # the adapter's name, as metrics and KV cache events report it
    sequences: list[Sample] = field(default_factory=list)  # beams: every beam ever forked, dead ones too
    # Beam search only: its state (set by the scheduler when the request is added), and the live
    # beams in the order of ``beam_search.scores``, best first; they run side by side.
    beam_search: BeamSearch | None = None
    beams: list[Sample] = field(default_factory=list)

    @property
    def fan_out(self) -> int:
        """How many sequences run side by side once the first token is sampled."""
        return self.params.beam_width if self.params.use_beam_search else self.params.n

    @property
    def is_finished(self) -> bool:
        if len(self.sequences) != self.params.n and not self.params.use_beam_search:
            return False
        # A loop rather than all() over a generator: this runs for every request every step.
        for seq in self.sequences:
            if seq.status is not _FINISHED:
                return False
        return True

    def spawn(self, token_ids: list[int]) -> Sample:
        """A new sample of this request: the first holds the prompt, forks copy their parent's tokens."""
        seq = Sample(seq_id=next(_seq_ids), request=self, index=len(self.sequences), token_ids=token_ids,
                     num_prompt_tokens=len(self.prompt_token_ids))
        self.sequences.append(seq)
        return seq
