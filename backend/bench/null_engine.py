"""The engine's control path with the model taken out: real Scheduler and KVCacheManager, no forward.

Every step does what ``LLMEngine._run`` does around the forward pass:
advance computed tokens, publish full blocks' prefix hashes, fork the ``n``
samples of a request whose prompt just finished (copy-on-write), append one
token to each sampled sequence and retire sequences at ``max_tokens``
(EOS is ignored, as in every benchmark workload). The "sampled" token is a
constant, so KV occupancy and scheduling match a real run token for token
(the benchmark tests check this against ``LLMEngine``), at a tiny cost.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler, SchedulerOutput

NULL_TOKEN = 7


class NullEngine:
    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
        enable_prefix_caching: bool = True, scheduling: str = "continuous",
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens,
                                   static_batching=scheduling == "static")
        self._ids = itertools.count()
        self.num_unfinished = 0

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        if params.max_tokens is None:
            raise ValueError("max_tokens must be set: the null engine never samples EOS")
        request = Request(str(next(self._ids)), None, tuple(prompt_token_ids), params)
        self.scheduler.add(self._sequence(request, list(prompt_token_ids)))
        self.num_unfinished += 1

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished > 0

    def step(self) -> SchedulerOutput:
        return self.advance(self.scheduler.schedule())

    def advance(self, out: SchedulerOutput) -> SchedulerOutput:
        """Everything after the forward pass of a scheduled step."""
        sampled = [item.seq for item in out.scheduled if item.completes_prefill]
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.cache_full_blocks(item.seq)
        for seq in sampled:
            family = [seq, *self._fork(seq)] if seq.needs_fork else [seq]
            for member in family:
                self._append(member)
        return out

    @property
    def tokens_held(self) -> int:
        """Tokens whose K/V the running sequences hold (shared prefixes counted once per sequence)."""
        return sum(seq.num_computed_tokens for seq in self.scheduler.running)

    def _append(self, seq: Sequence) -> None:
        seq.token_ids.append(NULL_TOKEN)
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None and seq.num_output_tokens >= max_tokens:
            seq.status = SequenceStatus.FINISHED
            self.scheduler.remove(seq)
            if seq.request.is_finished:
                self.num_unfinished -= 1

    def _fork(self, parent: Sequence) -> list[Sequence]:
        children = []
        for _ in range(len(parent.request.sequences), parent.request.params.n):
            child = self._sequence(parent.request, list(parent.token_ids))
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _sequence(self, request: Request, token_ids: list[int]) -> Sequence:
        # No detokenizer and no generator: nothing is decoded or sampled.
        seq = Sequence(next(self._ids), request, len(request.sequences), token_ids,
                       len(request.prompt_token_ids), None, None)  # type: ignore[arg-type]
        request.sequences.append(seq)
        return seq
