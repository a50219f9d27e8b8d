"""The engine's control path with the model taken out: real Scheduler and KVCacheManager, no forward.

Each step schedules, then applies the step through the scheduler's own
``update_from_output`` (the function ``LLMEngine`` uses), with a constant
"sampled" token standing in for the sampler. EOS never ends a request (as in
every benchmark workload), so KV occupancy and scheduling match a real run
token for token (the benchmark tests check this against ``LLMEngine``), at a
tiny cost. Beam groups take stand-in candidates too: every beam extends itself by
the constant token, so a group keeps its width until ``max_tokens``.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from pagedllm.core.beam_search import BeamCandidate, BeamSearch
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.stop_policy import StopPolicy
from pagedllm.core.sampling_params import SamplingParams

NULL_TOKEN = 7


class NullEngine:
    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
        enable_prefix_caching: bool = True, scheduling: str = "continuous", max_model_len: int = 1 << 30,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, StopPolicy(max_model_len),
                                   static_batching=scheduling == "static")
        self._ids = itertools.count()
        self._unfinished: set[Request] = set()

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> Request:
        if params.max_tokens is None:
            raise ValueError("max_tokens must be set: the null engine never samples EOS")
        request = Request(str(next(self._ids)), None, tuple(prompt_token_ids), params)
        self.scheduler.add(request.spawn(list(prompt_token_ids)))
        self._unfinished.add(request)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        candidates = [null_candidates(batch.request.beam_search, len(batch.beams))
                      for batch in out.beams if batch.request.beam_search is not None]
        for seq in self.scheduler.update_from_output(out, [NULL_TOKEN] * len(out.samples), candidates):
            if seq.request.is_finished:
                self._unfinished.discard(seq.request)
        return out

    @property
    def tokens_held(self) -> int:
        """Tokens whose K/V the running sequences hold (shared prefixes counted once per sequence)."""
        return sum(seq.num_computed_tokens for seq in self.scheduler.running)


def null_candidates(search: BeamSearch, num_beams: int) -> list[BeamCandidate]:
    """Stand-in candidates, best first: each live beam extends itself (the first step forks the prompt)."""
    candidates = [BeamCandidate(r % num_beams, NULL_TOKEN, search.scores[r % num_beams] - 1.0 - 1e3 * (r // num_beams))
                  for r in range(search.num_candidates)]
    return sorted(candidates, key=lambda c: -c.cumulative_logprob)
