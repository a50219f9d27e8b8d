"""The sharing benchmarks measure what they claim: branching chats and beam groups hold less KV than copies."""
from __future__ import annotations

from pagedllm.simulation.null_engine import NullEngine
from pagedllm_bench.sharing import branching_chat
from pagedllm.simulation.workloads import branching_levels, make_workload
from pagedllm.core.sampling_params import SamplingParams


def test_branching_chat_children_extend_their_parents_context() -> None:
    workload = make_workload("branching-chat", "quick")
    levels = branching_levels(workload)
    assert [len(level.requests) for level in levels] == [2, 4, 8]
    assert sum(len(level.requests) for level in levels) == len(workload.requests)
    for parents, children in zip(levels, levels[1:]):
        for child in children.requests:
            parent = [p for p in parents.requests
                      if child.prompt_token_ids[: len(p.prompt_token_ids)] == p.prompt_token_ids]
            assert len(parent) == 1, "each child extends exactly one parent's prompt"
            assert len(child.prompt_token_ids) > len(parent[0].prompt_token_ids)


def test_branching_chat_computes_less_prefill_and_holds_fewer_blocks_with_sharing() -> None:
    result = branching_chat(make_workload("branching-chat", "quick"))
    assert result["computed_shared"] < result["asked"] / 2
    assert result["peak_blocks_shared"] < result["peak_blocks_unshared"]


def test_a_beam_group_holds_fewer_blocks_than_independent_copies() -> None:
    prompt = list(range(1, 101))
    group = NullEngine(256, 16, 8, 2048, enable_prefix_caching=False)
    group.add_request(prompt, SamplingParams(beam_width=4, temperature=0, max_tokens=20))
    copies = NullEngine(256, 16, 8, 2048, enable_prefix_caching=False)
    for _ in range(4):
        copies.add_request(prompt, SamplingParams(temperature=0, max_tokens=20))
    for engine in (group, copies):
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    full = len(prompt) // 16
    assert copies.kv.peak_blocks_used == 4 * -(-(len(prompt) + 20) // 16)
    # The prompt's full blocks are held once; each beam holds only its own tail.
    assert group.kv.peak_blocks_used == full + 4 * (-(-(len(prompt) + 20) // 16) - full)
