"""Hypothesis drives the KV manager and scheduler with random add / step / abort, forks included.

Steps go through ``NullEngine``, i.e. the real ``Scheduler.schedule`` and
``Scheduler.update_from_output`` that ``LLMEngine`` uses, with random sampled
tokens (which may hit a request's stop ids). Requests with ``n > 1`` fork
their samples by copy-on-write. After every operation the block pool must
balance: free + referenced = total, each block's ref count equals the number
of block tables holding it, no block is both free and referenced, and no more
than ``max_num_seqs`` sequences run.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.bench.null_engine import NullEngine
from pagedllm.core.request import Request
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
STOP_TOKEN = 5


class Harness:
    def __init__(self, num_blocks: int, budget: int, max_seqs: int, prefix_caching: bool) -> None:
        self.engine = NullEngine(num_blocks, BLOCK_SIZE, max_seqs, budget, enable_prefix_caching=prefix_caching)
        self.requests: list[Request] = []

    def add(self, prompt: list[int], max_tokens: int, n: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, n=n, stop_token_ids=(STOP_TOKEN,))
        self.requests.append(self.engine.add_request(prompt, params))

    def step(self, tokens: list[int]) -> SchedulerOutput:
        scheduler = self.engine.scheduler
        out = scheduler.schedule()
        sampled = [tokens[i % len(tokens)] for i in range(len(out.samples))]
        scheduler.update_from_output(out, sampled)
        return out

    def abort(self, index: int) -> None:
        live = [seq for request in self.requests for seq in request.sequences if not seq.is_finished]
        if live:
            self.engine.scheduler.finish(live[index % len(live)], "abort")

    def check(self) -> None:
        kv = self.engine.kv
        scheduler = self.engine.scheduler
        live = [*scheduler.running, *scheduler.waiting]
        assert len(scheduler.running) <= scheduler.max_num_seqs, "more sequences running than max_num_seqs"
        held = Counter(b for seq in live for b in seq.block_ids)
        free_ids = set(kv._free)
        referenced = {b.block_id for b in kv.blocks if b.ref_count > 0}
        assert not free_ids & referenced, "a block is both free and referenced"
        assert len(free_ids) + len(referenced) == kv.num_blocks
        for block in kv.blocks:
            assert block.ref_count == held[block.block_id], f"block {block.block_id} ref count drifted"
        for seq in live:
            assert len(seq.block_ids) * BLOCK_SIZE >= seq.num_computed_tokens
        for request in self.requests:
            assert len(request.sequences) <= request.params.n


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(1, 12),
                  st.integers(1, 3)),
        st.tuples(st.just("step"), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=operations,
    num_blocks=st.integers(24, 48),
    budget=st.integers(1, 48),
    max_seqs=st.integers(3, 8),
    prefix_caching=st.booleans(),
)
def test_block_pool_balances_after_every_operation(
    ops: list[tuple], num_blocks: int, budget: int, max_seqs: int, prefix_caching: bool
) -> None:
    harness = Harness(num_blocks, budget, max_seqs, prefix_caching)
    for op in ops:
        if op[0] == "add":
            harness.add(op[1], op[2], op[3])
        elif op[0] == "step":
            harness.step(op[1])
        else:
            harness.abort(op[1])
        harness.check()
    # Drain: every request must finish and every block come back.
    for _ in range(2000):
        if not harness.engine.scheduler.has_work():
            break
        harness.step([1])
        harness.check()
    assert not harness.engine.scheduler.has_work(), "requests left hanging"
    assert harness.engine.kv.num_free_blocks == harness.engine.kv.num_blocks
    assert all(request.is_finished for request in harness.requests if len(request.sequences) == request.params.n)


def test_forks_of_two_requests_in_chunked_prefill_stay_within_max_num_seqs() -> None:
    """Both n=3 requests are admitted only if all six samples fit in max_num_seqs=4: the second waits."""
    harness = Harness(num_blocks=64, budget=4, max_seqs=4, prefix_caching=False)
    harness.add(list(range(10)), max_tokens=3, n=3)
    harness.add(list(range(10, 20)), max_tokens=3, n=3)
    peak = 0
    while harness.engine.scheduler.has_work():
        harness.step([1])
        harness.check()
        peak = max(peak, len(harness.engine.scheduler.running))
    assert peak == 3
    assert all(request.is_finished for request in harness.requests)
