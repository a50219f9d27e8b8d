"""Beam search decisions for one request, by transformers' rules, without torch.

Each step the engine hands over the best candidates over all live beams
(``BeamCandidate``: which beam, which token, the cumulative log-probability),
sorted best first. ``BeamSearch.step`` then does what transformers'
``generate(num_beams=k)`` does in one iteration:

* a candidate whose token is a stop id, or that reaches ``max_new_tokens``, *hits*;
* the next live beams are the best ``k`` candidates that do not hit;
* hits among the best ``k`` candidates become finished hypotheses, scored
  ``cumulative_logprob / new_length ** length_penalty``; the best ``k`` are kept;
* the search ends when every candidate hits, when ``early_stopping is True`` and
  ``k`` hypotheses are finished, or when no live beam can beat the worst kept
  hypothesis (``early_stopping`` False: judged at the current length; ``"never"``
  with a positive length penalty: at ``max_new_tokens``).

Scores are float32 values as transformers computes them (``_f32`` rounds each
operation like a float32 tensor op would), so comparisons decide the same way.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BeamCandidate:
    beam: int  # index of the live beam it extends
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop token included) and scores."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float  # after the length penalty
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True, slots=True)
class BeamStep:
    survivors: tuple[BeamCandidate, ...]  # the next live beams, best first; empty when done
    done: bool


class BeamSearch:
    def __init__(self, width: int, length_penalty: float, early_stopping: bool | str,
                 stop_token_ids: frozenset[int], max_new_tokens: int) -> None:
        if width < 1:
            raise ValueError(f"beam_width={width} is invalid: must be >= 1")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.stop_token_ids = stop_token_ids
        self.max_new_tokens = max_new_tokens
        self.scores: list[float] = [0.0]  # cumulative logprob of each live beam, best first
        self.hypotheses: list[Hypothesis] = []  # best first, at most ``width``
        self.num_output_tokens = 0  # of every live beam
        self.done = False
        self._improvable = True

    @property
    def num_candidates(self) -> int:
        """How many candidates a step needs: enough that ``width`` of them never hit a stop id."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def step(self, candidates: Sequence[BeamCandidate], beam_output: Callable[[int], Sequence[int]]) -> BeamStep:
        """Apply one step. ``candidates`` are sorted best first; ``beam_output(i)`` is live beam i's output
        so far (asked only for the beams that finish a hypothesis)."""
        if self.done:
            raise RuntimeError("beam search already finished")
        if any(not 0 <= c.beam < len(self.scores) for c in candidates):
            raise ValueError(f"a candidate extends a beam outside the {len(self.scores)} live ones")
        if len(candidates) < self.width:
            raise ValueError(f"{len(candidates)} candidates for beam width {self.width}")
        length = self.num_output_tokens + 1
        at_max = length >= self.max_new_tokens
        hits = [at_max or c.token_id in self.stop_token_ids for c in candidates]
        survivors = tuple(c for c, hit in zip(candidates, hits) if not hit)[: self.width]

        full = self.early_stopping is True and len(self.hypotheses) == self.width
        if self._improvable and not full:
            penalty = _f32(length**self.length_penalty)
            for candidate, hit in zip(candidates[: self.width], hits):
                if hit:
                    tokens = (*beam_output(candidate.beam), candidate.token_id)
                    reason = "stop" if candidate.token_id in self.stop_token_ids else "length"
                    score = _f32(candidate.cumulative_logprob / penalty)
                    self.hypotheses.append(Hypothesis(tokens, candidate.cumulative_logprob, score, reason))
            # Stable sort: on an exact tie the hypothesis kept earlier stays ahead.
            self.hypotheses.sort(key=lambda h: -h.score)
            del self.hypotheses[self.width :]

        self.num_output_tokens = length
        if self._improvable and len(self.hypotheses) == self.width and survivors:
            best_length = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
            best_possible = _f32(survivors[0].cumulative_logprob / _f32(best_length**self.length_penalty))
            self._improvable = best_possible > self.hypotheses[-1].score
        full = self.early_stopping is True and len(self.hypotheses) == self.width
        self.done = all(hits) or not self._improvable or full or len(survivors) < self.width
        if self.done:
            return BeamStep((), True)
        self.scores = [c.cumulative_logprob for c in survivors]
        return BeamStep(survivors, False)

    def best(self, n: int) -> list[Hypothesis]:
        return self.hypotheses[:n]


def _f32(value: float) -> float:
    """``value`` rounded to float32 (each of +, -, *, / on float32 inputs done in float64 then
    rounded gives the float32 result exactly)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def beam_chunks(remaining: list[int], ready: list[bool], budget: int) -> list[int]:
    """Tokens for each beam of a group this step, given what each has left to compute.

    The beams sample together: either all of them reach their last token this step,
    or each computes a chunk that stops short of it (a beam not ready computes nothing).
    """
    if all(ready) and sum(remaining) <= budget:
        return remaining
    chunks = []
    for left, may_compute in zip(remaining, ready):
        chunk = max(0, min(left - 1, budget)) if may_compute else 0
        chunks.append(chunk)
        budget -= chunk
    return chunks


def survivor_parents(survivors: Sequence[BeamCandidate]) -> tuple[dict[int, int], list[int]]:
    """How a step's survivors map onto the live beams: each beam that some survivor extends
    continues as its best one (beam -> that survivor's rank); every further survivor of the same
    beam is a fork of it (their ranks). Beams no survivor extends are dropped."""
    continuing: dict[int, int] = {}
    forks: list[int] = []
    for rank, candidate in enumerate(survivors):
        if candidate.beam in continuing:
            forks.append(rank)
        else:
            continuing[candidate.beam] = rank
    return continuing, forks


def shared_full_blocks(token_ids: list[int], leader_token_ids: list[int], block_size: int) -> int:
    """How many leading full blocks of a beam hold the same tokens as its leader's: the blocks it can
    share instead of recomputing. Its last token is never shared: its logits are needed."""
    common = 0
    while (common + 1) * block_size <= len(token_ids) - 1:
        block = slice(common * block_size, (common + 1) * block_size)
        if token_ids[block] != leader_token_ids[block]:
            break
        common += 1
    return common
