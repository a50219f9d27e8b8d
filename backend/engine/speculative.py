"""Speculative decoding, as vLLM v1 does it: proposals live in the scheduler and the paged KV cache.

After a step, each sequence that just sampled gets up to ``k`` proposed tokens
(``Sample.spec_token_ids``), from the n-gram proposer or the draft model. The next step schedules
them after the sequence's last token, in ordinary KV slots, and the model scores all ``k + 1``
positions in one forward. Verification (``verify``) is rejection sampling against the proposal
distribution ``q``, each position with its own sampling row (penalties counted over the tokens
before it, drafted ones included; ``min_tokens`` by its own output count; the sample's seeded
generator drawn in position order):

* ``q`` one-hot (n-gram proposals, and greedy requests whatever the proposer): the target's token
  is sampled at every position with the ordinary sampler and the drafts are kept while they equal
  it, then the target's token at the first mismatch (or the bonus token after ``k`` accepted ones).
  A draft ``x`` is so accepted with probability ``p(x) = min(1, p(x) / q(x))``, and a rejection
  leaves the target's draw conditioned on not being ``x``, which is the normalised ``max(p - q, 0)``.
* ``q`` from the draft model (sampled requests): draft ``x`` is accepted with probability
  ``min(1, p(x) / q(x))``; at the first rejection the token is drawn from the normalised
  ``max(p - q, 0)``; after ``k`` accepted drafts the bonus token is drawn from ``p``.

Either way the output distribution is the target's exactly, and under greedy sampling the tokens
are those of decoding without speculation. Seeded requests are reproducible, but draw a different
stream than without speculation.

Speculation is skipped for a step with more running sequences than the config's
``max_batch_size``, and for good for a request whose measured acceptance rate fell below
``disable_by_acceptance_rate``; beam search is refused by name. Structured outputs: drafts are cut at the first
token the sample's grammar refuses (the matcher walks them, then rolls back), each verified position
is masked to what the grammar allows after the drafts before it, and the matcher then advances by
the accepted run only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from pagedllm.core.request import Sample
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.stop_policy import StopPolicy
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.speculative_config import ACCEPTANCE_RATE_MIN_DRAFTS, SpeculativeConfig
from pagedllm.worker.draft_proposer import DraftProposer, DraftRequest
from pagedllm.worker.ngram_proposer import NgramProposer
from pagedllm.worker.sampler import SampledToken, SamplingRow, target_probs, with_logprobs

log = logging.getLogger(__name__)

# The engine's sampler with its per-row fault isolation: one token per row of ``rows`` (owned by the given
# samples), None (and an entry in ``errors``) for a row that made it fail.
SampleFn = Callable[[torch.Tensor, Seq[Sample], dict[str, str], Seq[SamplingRow]], list[SampledToken | None]]


class Grammars(Protocol):
    """Structured outputs as speculation needs them (``pagedllm.engine.structured_outputs``)."""

    def num_valid_drafts(self, seq: Sample, drafts: Seq[int]) -> int: ...

    def mask_positions(self, logits: torch.Tensor, seq: Sample, first_row: int, drafts: Seq[int]) -> None: ...


@dataclass(slots=True)
class SpecDecodeCounts:
    """Cumulative counts under vLLM's metric names (``vllm:spec_decode_*``)."""

    num_drafts: int = 0  # verifications of a sample holding at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i


class SpeculativeDecoding:
    def __init__(self, config: SpeculativeConfig, stop_policy: StopPolicy, grammars: Grammars,
                 draft: DraftProposer | None = None) -> None:
        if config.prompt_lookup_min is None or config.prompt_lookup_max is None:
            raise RuntimeError("SpeculativeConfig left its prompt lookup lengths unset")
        if (draft is None) != (config.method == "ngram"):
            raise RuntimeError(f"speculative_config.method={config.method!r} needs {'no' if draft else 'a'} draft model")
        self.config = config
        self.stop_policy = stop_policy
        self.grammars = grammars
        self.draft = draft
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.counts = SpecDecodeCounts(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self._q: dict[int, torch.Tensor] = {}  # seq id -> the draft model's q at each of its pending drafts
        self._tally: dict[int, list[int]] = {}  # seq id -> [drafted, accepted] over its life (preemptions included)
        self._stopped: set[int] = set()  # seq ids whose acceptance rate turned their speculation off

    @staticmethod
    def check_request(params: SamplingParams) -> None:
        """Refuse, by name, what speculation does not do."""
        if params.use_beam_search:
            raise ValueError(f"beam_width={params.beam_width} is not supported with speculative_config: "
                             "beam search scores every candidate, it has nothing to verify")

    def propose(self, out: SchedulerOutput, num_running: int, generator_of: Callable[[Sample], torch.Generator | None]
                ) -> None:
        """Give each live sample of this step its drafts for the next one (or none above the batch limit).
        The draft model also takes in the prompt chunks of sequences still prefilling."""
        limit = self.config.max_batch_size
        if limit is not None and num_running > limit:
            return
        live = [seq for seq in out.samples if not seq.is_finished and seq.seq_id not in self._stopped]
        # The target's token follows the drafts, so a run never passes max_tokens or max_model_len.
        room = [self.stop_policy.max_new_tokens(seq.request.params, seq.num_prompt_tokens) - seq.num_output_tokens - 1
                for seq in live]
        if self.draft is None:
            for seq, drafts in zip(live, self.proposer.propose(live, room)):
                seq.spec_token_ids = self._allowed(seq, drafts)
            return
        sampled = {seq.seq_id for seq in out.samples}
        prefilling = [item.seq for item in out.scheduled if item.seq.seq_id not in sampled
                      and not item.seq.is_finished and item.seq.seq_id not in self._stopped]
        requests = [DraftRequest(seq, max(0, most), _draft_temperature(seq.request.params), generator_of(seq))
                    for seq, most in zip(live, room)]
        requests += [DraftRequest(seq, 0, 0.0, None) for seq in prefilling]
        for seq, proposal in zip(live, self.draft.propose(requests)):
            seq.spec_token_ids = self._allowed(seq, proposal.token_ids)
            if proposal.probs is None or not seq.spec_token_ids:
                self._q.pop(seq.seq_id, None)
            else:
                self._q[seq.seq_id] = proposal.probs[: len(seq.spec_token_ids)]

    def _allowed(self, seq: Sample, drafts: list[int]) -> list[int]:
        """``drafts`` up to the first one ``seq``'s grammar refuses: that one would be rejected anyway."""
        if not drafts or seq.request.params.structured_outputs is None:
            return drafts
        return drafts[: self.grammars.num_valid_drafts(seq, drafts)]

    def verify(self, out: SchedulerOutput, logits: torch.Tensor, base_row: Callable[[Sample], SamplingRow],
               sample: SampleFn, errors: dict[str, str]) -> list[list[SampledToken] | None]:
        """Each sample's verified run (``None`` where it failed, with an entry in ``errors``): the accepted drafts,
        then the target's token. ``logits`` holds ``1 + k`` rows per completing sequence, one per position."""
        first_rows: list[int] = []  # each completing sequence's first logits row
        row = 0
        for index in out.completing:
            first_rows.append(row)
            row += 1 + len(out.scheduled[index].spec_token_ids)
        runs: list[list[SampledToken] | None] = [None] * len(out.samples)
        picks: list[int] = []  # the one-hot path: every position sampled by the ordinary sampler, in one batch
        rows: list[SamplingRow] = []
        owners: list[Sample] = []
        one_hot: list[tuple[int, tuple[int, ...]]] = []  # (sample index, drafts)
        for index, (seq, logit_row) in enumerate(zip(out.samples, out.sample_logit_rows)):
            drafts = out.scheduled[out.completing[logit_row]].spec_token_ids
            base = base_row(seq)
            position_rows = [base] + [self._position_row(seq, base, drafts[:position])
                                      for position in range(1, len(drafts) + 1)]
            first = first_rows[logit_row]
            if seq.request.params.structured_outputs is not None:
                self.grammars.mask_positions(logits, seq, first, drafts)
            q = self._q.pop(seq.seq_id, None)
            if drafts and q is not None and not base.params.greedy:
                runs[index] = self._rejection_sample(seq, drafts, q[: len(drafts)],
                                                     logits[first : first + len(drafts) + 1], position_rows, errors)
                continue
            one_hot.append((index, drafts))
            picks.extend(range(first, first + len(drafts) + 1))
            rows.extend(position_rows)
            owners.extend([seq] * len(position_rows))
        if picks == list(range(logits.shape[0])):  # every row, in order (a lone sequence): no gather to copy them
            tokens = sample(logits, owners, errors, rows)
        else:
            tokens = (sample(logits[torch.tensor(picks, device=logits.device, dtype=torch.long)], owners, errors, rows)
                      if picks else [])
        offset = 0
        for index, drafts in one_hot:
            target = tokens[offset : offset + len(drafts) + 1]
            offset += len(drafts) + 1
            if any(token is None for token in target):
                continue
            verified = [token for token in target if token is not None]
            runs[index] = self.accept(drafts, verified, out.samples[index].seq_id) if drafts else verified
        return runs

    def _position_row(self, seq: Sample, base: SamplingRow, drafts: tuple[int, ...]) -> SamplingRow:
        """The sampling row of the position after ``drafts``: penalties and ``min_tokens`` count them too."""
        params = base.params
        if base.penalties is None and not base.suppressed_token_ids:
            return base  # nothing counts the drafts, and min_tokens (if any) was reached before them
        penalties = None if base.penalties is None else base.penalties.extended(drafts)
        suppressed: tuple[int, ...] = ()
        if params.min_tokens and seq.num_output_tokens + len(drafts) < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.stop_policy.eos_token_ids)
            suppressed = (*eos, *params.stop_token_ids)
        return SamplingRow(params, base.generator, penalties, suppressed)

    def _rejection_sample(self, seq: Sample, drafts: tuple[int, ...], q: torch.Tensor, logits: torch.Tensor,
                          rows: Seq[SamplingRow], errors: dict[str, str]) -> list[SampledToken] | None:
        """Accept each draft with probability min(1, p/q); at the first rejection draw from max(p - q, 0)
        normalised; after every draft, the bonus token from p."""
        try:
            p = target_probs(logits, rows)
            generator = rows[0].generator
            q = q.to(p.device)
            index = torch.arange(len(drafts), device=p.device)
            ids = torch.tensor(drafts, device=p.device)
            ratio = (p[index, ids] / q[index, ids]).tolist()
            uniform = torch.rand(len(drafts), generator=generator, device=p.device).tolist()
            chosen = list(drafts)
            for position, (u, r) in enumerate(zip(uniform, ratio)):
                if u < r:
                    continue
                residual = (p[position] - q[position]).clamp_(min=0.0)
                if float(residual.sum()) <= 0.0:  # p <= q everywhere only when p == q: nothing to correct
                    residual = p[position]
                chosen[position:] = [int(torch.multinomial(residual, 1, generator=generator))]
                break
            else:
                chosen.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
            run = with_logprobs(logits[: len(chosen)], chosen, rows[: len(chosen)])
        except Exception as error:
            log.exception("verifying drafts failed for request %s", seq.request.request_id)
            errors[seq.request.request_id] = f"sampling failed: {error}"
            return None
        self._count(len(drafts), len(chosen) - 1, seq.seq_id)
        return run

    def accept(self, drafts: Seq[int], target: Seq[SampledToken], seq_id: int) -> list[SampledToken]:
        """The verified run: the drafts equal to the target's tokens at their positions, then the target's
        token after them. ``target`` holds the ``len(drafts) + 1`` tokens sampled at the drafts' positions."""
        accepted = 0
        while accepted < len(drafts) and target[accepted].token_id == drafts[accepted]:
            accepted += 1
        self._count(len(drafts), accepted, seq_id)
        return list(target[: accepted + 1])

    def _count(self, num_drafted: int, num_accepted: int, seq_id: int) -> None:
        rate = self.config.disable_by_acceptance_rate
        if rate is not None:
            tally = self._tally.setdefault(seq_id, [0, 0])
            tally[0] += num_drafted
            tally[1] += num_accepted
            if tally[0] >= ACCEPTANCE_RATE_MIN_DRAFTS and tally[1] < rate * tally[0]:
                self._stopped.add(seq_id)
                if self.draft is not None:
                    self.draft.release([seq_id])  # it will not propose again: its draft K/V is not needed
        counts = self.counts
        counts.num_drafts += 1
        counts.num_draft_tokens += num_drafted
        counts.num_accepted_tokens += num_accepted
        per_position = counts.num_accepted_tokens_per_pos
        for position in range(num_accepted):
            per_position[position] += 1

    def snapshot(self) -> SpecDecodeCounts:
        """A copy of the counts, safe to hand to another thread or process."""
        return replace(self.counts, num_accepted_tokens_per_pos=list(self.counts.num_accepted_tokens_per_pos))

    def release(self, finished: Iterable[int], preempted: Iterable[int] = ()) -> None:
        """Forget sequences that finished; drop what preempted ones held in the KV cache."""
        finished = list(finished)
        dropped = [*finished, *preempted]
        self.proposer.release(dropped)
        if self.draft is not None:
            self.draft.release(dropped)
        for seq_id in dropped:
            self._q.pop(seq_id, None)
        for seq_id in finished:
            self._tally.pop(seq_id, None)
            self._stopped.discard(seq_id)


def _draft_temperature(params: SamplingParams) -> float:
    """The temperature the draft samples at: the request's (0, its argmax, for a greedy request)."""
    return 0.0 if params.greedy else params.temperature
