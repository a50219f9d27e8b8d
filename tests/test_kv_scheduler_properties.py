"""Hypothesis drives the KV manager and scheduler with random add / step / abort, forks included.

Steps go through ``NullEngine``, i.e. the real ``Scheduler.schedule`` and
``Scheduler.update_from_output`` that ``LLMEngine`` uses, with random sampled
tokens (which may hit a request's stop ids). Requests with ``n > 1`` fork
their samples by copy-on-write. Beam requests get random candidates each step
(random parents, tokens that may be stop ids, random scores), so beams fork
and die in random patterns; their beams must run, wait and be preempted as one
unit, side by side in the queues. After every operation the block pool must
balance: free + referenced = total, each block's ref count equals the number
of block tables holding it, no block is both free and referenced, and no more
than ``max_num_seqs`` sequences run. Each step also stands in for a forward on a
cache of token ids: copies, then every scheduled token written to its slot; then
each scheduled sequence's blocks must hold its own tokens up to where it computes,
prefix-cache hits included (blocks adopted in the step that computes them too).
"""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.simulation.null_engine import NullEngine
from pagedllm.core.beam_search import BeamCandidate
from pagedllm.core.request import Request, SampleStatus
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.sampling_params import SamplingParams

BLOCK_SIZE = 4
STOP_TOKEN = 5


class Harness:
    def __init__(self, num_blocks: int, budget: int, max_seqs: int, prefix_caching: bool) -> None:
        self.engine = NullEngine(num_blocks, BLOCK_SIZE, max_seqs, budget, enable_prefix_caching=prefix_caching)
        self.requests: list[Request] = []
        self.cache: dict[int, dict[int, int]] = {}  # block id -> slot -> the token whose KV it holds
        self.budget = budget
        self.max_seqs = max_seqs

    def add(self, prompt: list[int], max_tokens: int, n: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, n=n, stop_token_ids=(STOP_TOKEN,))
        self.requests.append(self.engine.add_request(prompt, params))

    def add_beams(self, prompt: list[int], max_tokens: int, width: int, n: int) -> None:
        if width > min(self.budget, self.max_seqs):
            return  # the engine refuses it: every beam computes a token in the same step
        params = SamplingParams(max_tokens=max_tokens, beam_width=width, n=min(n, width), temperature=0,
                                stop_token_ids=(STOP_TOKEN,))
        self.requests.append(self.engine.add_request(prompt, params))

    def step(self, tokens: list[int]) -> SchedulerOutput:
        scheduler = self.engine.scheduler
        out = scheduler.schedule()
        self.forward(out)
        sampled = [tokens[i % len(tokens)] for i in range(len(out.samples))]
        candidates = [random_candidates(batch.request, tokens) for batch in out.beams]
        for batch in out.beams:
            assert list(batch.beams) == batch.request.beams, "a beam group samples only whole"
        scheduler.update_from_output(out, sampled, candidates)
        return out

    def forward(self, out: SchedulerOutput) -> None:
        """Write the step's tokens as a forward writes keys and values (after its block copies), then check
        that every scheduled sequence attends to its own tokens."""
        for source, destination in out.block_copies:
            self.cache[destination] = dict(self.cache.get(source, {}))
        for item in out.scheduled:
            seq = item.seq
            for position in range(seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens):
                self.cache.setdefault(seq.block_ids[position // BLOCK_SIZE], {})[position % BLOCK_SIZE] = (
                    seq.token_ids[position])
        for item in out.scheduled:
            seq = item.seq
            end = seq.num_computed_tokens + item.num_tokens
            held = [self.cache.get(seq.block_ids[p // BLOCK_SIZE], {}).get(p % BLOCK_SIZE) for p in range(end)]
            assert held == seq.token_ids[:end], f"sequence {seq.seq_id} attends to KV of other tokens"

    def abort(self, index: int) -> None:
        live = [seq for request in self.requests for seq in request.sequences if not seq.is_finished]
        if live:
            victim = live[index % len(live)]
            # A beam search is cancelled whole, as the engine does.
            group = victim.request.sequences if victim.request.params.use_beam_search else [victim]
            for seq in group:
                self.engine.scheduler.finish(seq, "abort")

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
            if request.params.use_beam_search:
                self.check_beam_group(request)
            else:
                assert len(request.sequences) <= request.params.n

    def check_beam_group(self, request: Request) -> None:
        """The live beams are one unit: all running side by side, or all waiting side by side."""
        live = [seq for seq in request.sequences if not seq.is_finished]
        if not live:
            return
        assert set(live) == set(request.beams)
        assert len(live) in (1, request.params.beam_width)
        statuses = {seq.status for seq in live}
        assert len(statuses) == 1, "a beam group is split between running and waiting"
        queue = list(self.engine.scheduler.running if statuses == {SampleStatus.RUNNING}
                     else self.engine.scheduler.waiting)
        places = sorted(queue.index(seq) for seq in live)
        assert places == list(range(places[0], places[0] + len(live))), "a beam group is not side by side"


def random_candidates(request: Request, tokens: list[int]) -> list[BeamCandidate]:
    """Candidates from the drawn tokens: random parents, tokens (stop ids among them) and scores, best first."""
    search = request.beam_search
    assert search is not None
    num_beams = len(search.scores)
    candidates = [
        BeamCandidate(tokens[j % len(tokens)] % num_beams, tokens[(j + 1) % len(tokens)] + 10 * j,
                      search.scores[tokens[j % len(tokens)] % num_beams] - 1.0 - tokens[(j + 2) % len(tokens)] / 3)
        for j in range(search.num_candidates)
    ]
    # A stop id among them: make some of it end hypotheses, keeping tokens distinct per parent.
    candidates = [c if c.token_id % 7 else BeamCandidate(c.beam, STOP_TOKEN, c.cumulative_logprob) for c in candidates]
    return sorted(candidates, key=lambda c: -c.cumulative_logprob)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(1, 12),
                  st.integers(1, 3)),
        st.tuples(st.just("step"), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("beams"), st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(1, 8),
                  st.integers(2, 3), st.integers(1, 3)),
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
        elif op[0] == "beams":
            harness.add_beams(op[1], op[2], op[3], op[4])
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


def test_a_preempted_beam_group_resumes_when_part_of_its_cached_prompt_was_evicted() -> None:
    """With prefix caching, a preempted group's prompt blocks may be partly reused by others by the time it
    returns; its beams must still share the leader's blocks, or the group outgrows the pool admission sized."""
    prompt = list(range(1, 14))
    prompt_blocks, longest_blocks = 13 // BLOCK_SIZE, -(-(13 + 12) // BLOCK_SIZE)
    harness = Harness(num_blocks=prompt_blocks + 3 * (longest_blocks - prompt_blocks), budget=64, max_seqs=8,
                      prefix_caching=True)
    harness.add_beams(prompt, max_tokens=12, width=3, n=2)
    (request,) = harness.requests
    scheduler, kv = harness.engine.scheduler, harness.engine.kv
    for _ in range(9):
        harness.engine.step()
    assert len(request.beams) == 3 and not request.is_finished
    scheduler._preempt_last()
    # The second prompt block is taken for other work: the cache now serves only the first.
    second = tuple(prompt[BLOCK_SIZE : 2 * BLOCK_SIZE])
    evicted = next(block for block in kv._cached.values() if block.tokens == second)
    kv._cached.pop(evicted.block_hash)
    evicted.block_hash, evicted.tokens, evicted.epoch = None, (), evicted.epoch + 1
    for _ in range(200):
        if not scheduler.has_work():
            break
        harness.engine.step()
        harness.check()
    assert request.is_finished, "the preempted group never resumed"
    assert kv.num_free_blocks == kv.num_blocks


def test_a_preempted_beam_group_waits_whole_and_resumes_whole() -> None:
    """Two width-3 groups whose beams all survive, in a pool that holds one group at full length only with
    its prompt shared (the engine's admission rule): the newer is preempted as a unit, requeued side by side,
    and recomputed with its beams sharing the prompt's full blocks again; both finish with every block back."""
    prompt_blocks, longest_blocks = 13 // BLOCK_SIZE, -(-(13 + 12) // BLOCK_SIZE)
    harness = Harness(num_blocks=prompt_blocks + 3 * (longest_blocks - prompt_blocks), budget=64, max_seqs=8,
                      prefix_caching=False)
    harness.add_beams(list(range(1, 14)), max_tokens=12, width=3, n=2)
    harness.add_beams(list(range(20, 33)), max_tokens=12, width=3, n=2)
    for _ in range(200):
        if not harness.engine.scheduler.has_work():
            break
        harness.engine.step()  # stand-in candidates: every beam extends itself
        harness.check()
        for request in harness.requests:
            tables = [beam.block_ids for beam in request.beams if beam.block_ids]
            if len(tables) == 3 and all(len(table) > prompt_blocks for table in tables):
                assert all(table[:prompt_blocks] == tables[0][:prompt_blocks] for table in tables)
    assert not harness.engine.scheduler.has_work(), "a recomputed group did not fit again"
    assert harness.engine.scheduler.num_preemptions > 0
    assert harness.engine.kv.num_free_blocks == harness.engine.kv.num_blocks
    for request in harness.requests:
        assert request.is_finished
        assert [len(h.token_ids) for h in request.beam_search.hypotheses] == [12, 12, 12]


def test_requests_admitted_together_compute_their_shared_prefix_once() -> None:
    """A burst sharing a two-block prefix: the first request computes it, the two admitted beside it in the
    same step adopt its blocks and compute only their own last block; then a fourth, one step later, too."""
    harness = Harness(num_blocks=32, budget=64, max_seqs=8, prefix_caching=True)
    prefix = [1, 2, 3, 4, 6, 7, 8, 9]
    for suffix in ([10, 11, 12], [13, 14, 15], [16, 17, 18]):
        harness.add(prefix + suffix, max_tokens=2, n=1)
    out = harness.step([1])
    assert [item.num_tokens for item in out.scheduled] == [11, 3, 3]
    first, second, third = (request.sequences[0] for request in harness.requests)
    assert second.block_ids[:2] == third.block_ids[:2] == first.block_ids[:2]
    harness.add(prefix + [19, 20, 21], max_tokens=2, n=1)
    assert [item.num_tokens for item in harness.step([1]).scheduled][-1] == 3
    kv = harness.engine.kv
    assert (kv.prefix_hit_tokens, kv.prefix_queried_tokens) == (3 * len(prefix), 4 * 11)
