"""Hypothesis drives the KV manager and scheduler with random add / step / abort / fork.

A null model stands in for the runner: each step, every sequence whose
scheduled chunk reaches its last token "samples" a token. After every
operation the block pool must balance: free + referenced = total, each
block's ref count equals the number of block tables holding it, and no
block is both free and referenced.
"""
from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler

BLOCK_SIZE = 4


class NullEngine:
    """Just enough engine to exercise the scheduler without a model."""

    def __init__(self, num_blocks: int, budget: int, max_seqs: int, prefix_caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching)
        self.scheduler = Scheduler(self.kv, max_seqs, budget)
        self.live: list[Sequence] = []
        self.ids = itertools.count()

    def add(self, prompt: list[int], max_tokens: int) -> None:
        request = Request(str(next(self.ids)), None, tuple(prompt), SamplingParams(max_tokens=max_tokens))
        seq = self._sequence(request, list(prompt))
        self.scheduler.add(seq)

    def _sequence(self, request: Request, tokens: list[int]) -> Sequence:
        seq = Sequence(next(self.ids), request, len(request.sequences), tokens, len(request.prompt_token_ids), None, None)
        request.sequences.append(seq)
        self.live.append(seq)
        return seq

    def step(self, fork: bool) -> None:
        out = self.scheduler.schedule()
        for item in out.scheduled:
            seq = item.seq
            samples = item.completes_prefill
            seq.num_computed_tokens += item.num_tokens
            self.kv.cache_full_blocks(seq)
            if not samples:
                continue
            if fork and seq.num_output_tokens == 0 and seq.status is SequenceStatus.RUNNING:
                child = self._sequence(seq.request, list(seq.token_ids))
                self.kv.fork(seq, child)
                self.scheduler.add_running(child)
            seq.token_ids.append(seq.num_tokens % 7)
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                self.finish(seq)
        for child in [s for s in self.live if s.status is SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens]:
            child.token_ids.append(3)  # a fresh fork samples its first token in the same step

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq)
        self.live.remove(seq)

    def abort(self, index: int) -> None:
        if self.live:
            self.finish(self.live[index % len(self.live)])

    def check(self) -> None:
        kv = self.kv
        held = Counter(b for seq in self.live for b in seq.block_ids)
        free_ids = set(kv._free)
        referenced = {b.block_id for b in kv.blocks if b.ref_count > 0}
        assert not free_ids & referenced, "a block is both free and referenced"
        assert len(free_ids) + len(referenced) == kv.num_blocks
        for block in kv.blocks:
            assert block.ref_count == held[block.block_id], f"block {block.block_id} ref count drifted"
        for seq in self.live:
            assert len(seq.block_ids) * BLOCK_SIZE >= seq.num_computed_tokens


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(1, 12)),
        st.tuples(st.just("step"), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=operations,
    num_blocks=st.integers(12, 40),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
)
def test_block_pool_balances_after_every_operation(
    ops: list[tuple], num_blocks: int, budget: int, max_seqs: int, prefix_caching: bool
) -> None:
    engine = NullEngine(num_blocks, budget, max_seqs, prefix_caching)
    for op in ops:
        if op[0] == "add":
            engine.add(op[1], op[2])
        elif op[0] == "step":
            engine.step(fork=op[1])
        else:
            engine.abort(op[1])
        engine.check()
    # Drain: every request must finish and every block come back.
    for _ in range(2000):
        if not engine.scheduler.has_work():
            break
        engine.step(fork=False)
        engine.check()
    assert not engine.scheduler.has_work(), "requests left hanging"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
