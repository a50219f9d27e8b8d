"""Batched token sampling: penalties, suppression, greedy, temperature, top-k/top-p/min-p, seeds, logprobs.

Semantics follow vLLM. Every step works on the whole batch at once; a filter
runs only when some row needs it. Seeded rows draw their noise from their own
generator, so a seeded sample does not depend on what else shares the batch.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedllm.core.sampling_params import SamplingParams


class PenaltyState:
    """One sample's prompt-token mask and output-token counts for the penalties, kept incrementally.

    ``append`` is O(1) per sampled token; the vocabulary-sized tensors are built
    on first use and then only updated with the tokens appended since, so a
    step never walks a sample's whole context.
    """

    __slots__ = ("_prompt", "_pending", "_mask", "_counts", "_base")

    def __init__(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()) -> None:
        self._prompt = tuple(prompt_token_ids)
        self._pending = list(output_token_ids)
        self._mask: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._base: PenaltyState | None = None

    def append(self, token_id: int) -> None:
        self._pending.append(token_id)

    def extended(self, token_ids: Sequence[int]) -> PenaltyState:
        """A one-use view of this history followed by ``token_ids`` (the drafted tokens before a speculated
        position), leaving this one as it is."""
        view = PenaltyState((), token_ids)
        view._base = self
        return view

    def tensors(self, vocab: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_prompt bool [vocab], output counts [vocab])."""
        if self._base is not None:
            mask, counts = self._base.tensors(vocab, device, dtype)
            counts = counts.clone()
            if self._pending:
                ids = torch.tensor(self._pending, dtype=torch.long, device=device)
                counts.index_add_(0, ids, torch.ones(len(self._pending), dtype=dtype, device=device))
            return mask, counts
        if self._mask is None or self._counts is None:
            self._mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._mask[torch.tensor(self._prompt, dtype=torch.long, device=device)] = True
            self._counts = torch.zeros(vocab, dtype=dtype, device=device)
            self._prompt = ()
        if self._pending:
            ids = torch.tensor(self._pending, dtype=torch.long, device=device)
            self._counts.index_add_(0, ids, torch.ones(len(self._pending), dtype=dtype, device=device))
            self._pending.clear()
        return self._mask, self._counts


def needs_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded per sample; None draws from the global RNG
    penalties: PenaltyState | None  # the sample's token history, when its params have penalties
    suppressed_token_ids: tuple[int, ...]  # must not be sampled now (EOS/stop ids under min_tokens)
    # Greedy with nothing to edit or report: an argmax of the raw logits is the whole answer. Worked out
    # once per row here, not for every row of every step.
    argmax_only: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        argmax_only = (params.greedy and params.logprobs is None and not self.suppressed_token_ids
                       and not needs_penalties(params))
        object.__setattr__(self, "argmax_only", argmax_only)


# Not frozen, like the other records built per token per step: a frozen __init__ costs several times more.
@dataclass(slots=True)
class SampledToken:
    token_id: int
    # Of the chosen token under log_softmax of the unprocessed logits; None unless params.logprobs is set
    # (as in vLLM: a full-vocabulary log_softmax per row is most of a greedy batch's sampling time).
    logprob: float | None
    top_logprobs: dict[int, float] | None  # when params.logprobs is set: top ids and the chosen one


def make_generator(seed: int | None, sample_index: int, device: torch.device) -> torch.Generator | None:
    """A generator for sample ``sample_index`` of a request seeded with ``seed``; None when unseeded.

    The seed is mixed with the sample index through a stable hash (not Python's
    salted ``hash``), so every sample of an ``n > 1`` request gets its own stream
    and each stream is the same in every process.
    """
    if seed is None:
        return None
    if sample_index < 0:
        raise ValueError(f"sample_index={sample_index} is invalid: must be >= 0")
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return generator


class Sampler:
    """Picks one token per row of a ``[rows, vocab]`` float32 logits tensor."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must have shape [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return []
        raw = logits.float()
        if all([row.argmax_only for row in rows]):  # the common greedy batch: nothing to copy, mask or report
            return [SampledToken(token_id, None, None) for token_id in argmax_rows(raw).tolist()]
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        edits = any(row.suppressed_token_ids or needs_penalties(row.params) for row in rows)
        if not edits and not random_rows:  # greedy, but some rows report logprobs
            return _results(raw, argmax_rows(raw), rows)
        work = raw.clone()
        apply_penalties(work, rows)
        apply_suppression(work, rows)

        chosen = torch.empty(len(rows), dtype=torch.long, device=work.device)
        greedy_rows = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy_rows:
            index = _index(greedy_rows, work.device)
            chosen[index] = argmax_rows(work[index])
        if random_rows:
            index = _index(random_rows, work.device)
            chosen[index] = _sample(work[index], [rows[i] for i in random_rows])
        return _results(raw, chosen, rows)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax; ties and NaNs pick the lowest id."""
    if logits.device.type == "cpu":
        # numpy's SIMD argmax is about ten times faster than torch's on CPU, with the same tie and NaN rules.
        return torch.from_numpy(logits.detach().numpy().argmax(axis=1))
    return logits.argmax(dim=-1)


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition (prompt + output), then frequency and presence (output only), in place."""
    penalized = [i for i, row in enumerate(rows) if needs_penalties(row.params)]
    if not penalized:
        return
    device = logits.device
    vocab = logits.shape[1]
    index = _index(penalized, device)
    sub = logits[index]
    chosen_rows = [rows[i] for i in penalized]
    states = [(row.penalties or PenaltyState(())).tensors(vocab, device, sub.dtype) for row in chosen_rows]
    in_prompt = torch.stack([mask for mask, _ in states])
    counts = torch.stack([count for _, count in states])
    in_output = counts > 0

    if any(r.params.repetition_penalty != 1.0 for r in chosen_rows):
        repetition = torch.tensor([r.params.repetition_penalty for r in chosen_rows], dtype=sub.dtype, device=device)
        factor = repetition.unsqueeze(1)
        penalized_values = torch.where(sub > 0, sub / factor, sub * factor)
        sub = torch.where(in_prompt | in_output, penalized_values, sub)

    frequency = torch.tensor([r.params.frequency_penalty for r in chosen_rows], dtype=sub.dtype, device=device)
    presence = torch.tensor([r.params.presence_penalty for r in chosen_rows], dtype=sub.dtype, device=device)
    sub = sub - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * in_output.to(sub.dtype)
    logits[index] = sub


def apply_suppression(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_ids = [i for i, row in enumerate(rows) for _ in row.suppressed_token_ids]
    if not row_ids:
        return
    token_ids = [t for row in rows for t in row.suppressed_token_ids]
    vocab = logits.shape[1]
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"suppressed_token_ids {bad} are outside the vocabulary [0, {vocab})")
    logits[_index(row_ids, logits.device), _index(token_ids, logits.device)] = float("-inf")


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row; ``logits`` is a private copy."""
    probs = _filtered_probs(logits, rows)
    device = logits.device
    vocab = logits.shape[1]
    # Gumbel-max in exponential form: argmax(p / E) with E ~ Exp(1) is a draw from p. E is drawn as
    # -log(U), U ~ uniform: torch's CPU exponential_ is ~3-6x slower than uniform_ + log_ (2048-32000
    # entries, 1 thread), and seeded rows draw one vocabulary-wide row each per step.
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        if len(unseeded) == len(rows):
            noise.uniform_()
        else:
            shared = torch.empty(len(unseeded), vocab, dtype=probs.dtype, device=device).uniform_()
            noise[_index(unseeded, device)] = shared
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i].uniform_(generator=row.generator)
    return argmax_rows(probs / noise.log_().neg_())


def _filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each row draws from: temperature, top-k, top-p, min-p; ``logits`` is a private copy."""
    device = logits.device
    vocab = logits.shape[1]
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device)
    logits.div_(temperature.unsqueeze(1))

    use_top_k = any(r.params.top_k != -1 for r in rows)
    use_top_p = any(r.params.top_p < 1.0 for r in rows)
    if use_top_k or use_top_p:
        ascending, order = logits.sort(dim=-1)
        if use_top_k:
            k = torch.tensor([vocab if r.params.top_k == -1 else min(r.params.top_k, vocab) for r in rows],
                             dtype=torch.long, device=device)
            # Ties with the k-th largest value are kept, as in vLLM.
            kth_largest = ascending.gather(1, (vocab - k).unsqueeze(1))
            ascending.masked_fill_(ascending < kth_largest, float("-inf"))
        if use_top_p:
            top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
            outside = cumulative <= (1.0 - top_p).unsqueeze(1)
            outside[:, -1] = False  # the most likely token always survives
            ascending.masked_fill_(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, ascending)

    if any(r.params.min_p > 0.0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype, device=device)
        probs = logits.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits.softmax(dim=-1)


def target_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution the sampler draws each row's token from (penalties, suppression, temperature and the
    filters applied), for rows that are not greedy: what rejection sampling calls ``p``."""
    work = logits.float().clone()
    apply_penalties(work, rows)
    apply_suppression(work, rows)
    return _filtered_probs(work, rows)


def with_logprobs(raw: torch.Tensor, token_ids: Sequence[int], rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """``token_ids`` (one per row, chosen elsewhere) as the sampler reports them, logprobs included."""
    return _results(raw.float(), torch.tensor(token_ids, dtype=torch.long, device=raw.device), rows)


def _results(raw: torch.Tensor, chosen: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    token_ids = chosen.tolist()
    wanting = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanting:
        return [SampledToken(token_id, None, None) for token_id in token_ids]
    index = _index(wanting, raw.device)
    # One fused log_softmax pass is about twice as fast as gather - logsumexp, which is composite on CPU
    # (scripts/ab_cpu_choices.py), and a token's logprob then equals its top_logprobs entry exactly.
    logprobs = raw[index].log_softmax(dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen[index].unsqueeze(1)).squeeze(1).tolist()
    width = min(max(rows[i].params.logprobs or 0 for i in wanting), raw.shape[1])
    values, ids = logprobs.topk(width, dim=-1)
    tokens = [SampledToken(token_id, None, None) for token_id in token_ids]
    for i, logprob, top_ids, top_values in zip(wanting, chosen_logprobs, ids.tolist(), values.tolist()):
        k = rows[i].params.logprobs or 0
        top = dict(zip(top_ids[:k], top_values[:k]))
        top[token_ids[i]] = logprob
        tokens[i] = SampledToken(token_ids[i], logprob, top)
    return tokens
