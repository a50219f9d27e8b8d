"""Speculative decoding, as vLLM v1 does it: proposals live in the scheduler and the paged KV cache.

After a step, each sequence that just sampled gets up to ``k`` proposed tokens
(``Sample.spec_token_ids``, from the n-gram proposer). The next step schedules them after
the sequence's last token, in ordinary KV slots, and the model scores all ``k + 1`` positions
in one forward. Verification then samples the target's token at every position with the
ordinary sampler, each position with its own sampling row (penalties counted over the tokens
before it, drafted ones included; ``min_tokens`` by its own output count; the sample's seeded
generator drawn in position order), and keeps the drafts while they equal the target's token,
then the target's token at the first mismatch (or the bonus token after ``k`` accepted ones).

This is rejection sampling with the proposal as a one-hot ``q``: a draft ``x`` is accepted with
probability ``p(x) = min(1, p(x) / q(x))``, and a rejection leaves the target's draw conditioned
on not being ``x``, which is the normalised ``max(p - q, 0)``. So the output distribution is the
target's exactly, and under greedy sampling the tokens are those of decoding without
speculation. Seeded requests are reproducible, but draw a different stream than without
speculation (every verified position draws).

Speculation is skipped for a step with more running sequences than the config's
``max_batch_size``; beam search and structured outputs are refused by name.
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

from pagedllm.core.request import Sample
from pagedllm.core.stop_policy import StopPolicy
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.speculative_config import SpeculativeConfig
from pagedllm.worker.ngram_proposer import NgramProposer
from pagedllm.worker.sampler import SampledToken


@dataclass(slots=True)
class SpecDecodeCounts:
    """Cumulative counts under vLLM's metric names (``vllm:spec_decode_*``)."""

    num_drafts: int = 0  # verifications of a sample holding at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i


def check_supported(config: SpeculativeConfig) -> None:
    """Refuse, naming it, a configuration this engine cannot run (checked before any weights load)."""
    if config.method != "ngram":
        raise ValueError(f"speculative_config.method={config.method!r} is not supported yet: use 'ngram'")


class SpeculativeDecoding:
    def __init__(self, config: SpeculativeConfig, stop_policy: StopPolicy) -> None:
        check_supported(config)
        if config.prompt_lookup_min is None or config.prompt_lookup_max is None:
            raise RuntimeError("SpeculativeConfig left its prompt lookup lengths unset")
        self.config = config
        self.stop_policy = stop_policy
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.counts = SpecDecodeCounts(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)

    @staticmethod
    def check_request(params: SamplingParams) -> None:
        """Refuse, by name, what speculation does not do."""
        if params.use_beam_search:
            raise ValueError(f"beam_width={params.beam_width} is not supported with speculative_config: "
                             "beam search scores every candidate, it has nothing to verify")
        if params.structured_outputs is not None:
            raise ValueError("structured_outputs is not supported with speculative_config yet: drafted tokens "
                             "would need the grammar matcher to roll back")

    def propose(self, samples: Seq[Sample], num_running: int) -> None:
        """Give each live sample of this step its drafts for the next one (or none above the batch limit)."""
        limit = self.config.max_batch_size
        if limit is not None and num_running > limit:
            return
        live = [seq for seq in samples if not seq.is_finished]
        # The target's token follows the drafts, so a run never passes max_tokens or max_model_len.
        room = [self.stop_policy.max_new_tokens(seq.request.params, seq.num_prompt_tokens) - seq.num_output_tokens - 1
                for seq in live]
        for seq, drafts in zip(live, self.proposer.propose(live, room)):
            seq.spec_token_ids = drafts

    def accept(self, drafts: Seq[int], target: Seq[SampledToken]) -> list[SampledToken]:
        """The verified run: the drafts equal to the target's tokens at their positions, then the target's
        token after them. ``target`` holds the ``len(drafts) + 1`` tokens sampled at the drafts' positions."""
        accepted = 0
        while accepted < len(drafts) and target[accepted].token_id == drafts[accepted]:
            accepted += 1
        counts = self.counts
        counts.num_drafts += 1
        counts.num_draft_tokens += len(drafts)
        counts.num_accepted_tokens += accepted
        per_position = counts.num_accepted_tokens_per_pos
        for position in range(accepted):
            per_position[position] += 1
        return list(target[: accepted + 1])

    def snapshot(self) -> SpecDecodeCounts:
        """A copy of the counts, safe to hand to another thread or process."""
        return replace(self.counts, num_accepted_tokens_per_pos=list(self.counts.num_accepted_tokens_per_pos))

    def release(self, seq_ids: Iterable[int]) -> None:
        self.proposer.release(seq_ids)
