"""Triton-lang fused MoE (under the interpreter) against the plain-torch CPU path, and the expert alignment.

CPU tensors always run in triton's interpreter; shapes stay small because it is slow.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedllm.kernels.fused_moe import MoeTiles, fused_moe, fused_moe_with_tiles
from pagedllm.kernels.fused_moe_align import align_tokens_by_expert
from pagedllm.kernels.fused_moe_reference import fused_moe_ref

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}


@dataclass(frozen=True, slots=True)
class Case:
    num_tokens: int
    hidden: int
    inter: int
    num_experts: int
    top_k: int
    tiles: MoeTiles
    chosen_experts: tuple[int, ...] | None = None  # route only to these; the others get no tokens
    dtype: torch.dtype = torch.float32


# Hidden and intermediate widths, token counts and expert counts that no tile size divides.
CASES = {
    "top1-e4": Case(13, 40, 24, 4, 1, MoeTiles(16, 16, 16)),
    "top2-e7-rows-cross-blocks": Case(37, 24, 40, 7, 2, MoeTiles(16, 32, 16)),
    "top2-e8-two-experts-used": Case(11, 40, 24, 8, 2, MoeTiles(16, 16, 32), chosen_experts=(2, 5)),
    "top8-e16": Case(5, 24, 20, 16, 8, MoeTiles(16, 16, 16)),
    "top8-e64-most-experts-empty": Case(3, 24, 20, 64, 8, MoeTiles(16, 32, 32)),
    "top2-e6-block32-fp16": Case(19, 40, 24, 6, 2, MoeTiles(32, 16, 16), dtype=torch.float16),
    "top2-e5-bf16": Case(7, 24, 20, 5, 2, MoeTiles(16, 16, 16), dtype=torch.bfloat16),
}


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(case.num_tokens, case.hidden, generator=generator)
    w_gate_up = torch.randn(case.num_experts, 2 * case.inter, case.hidden, generator=generator) / case.hidden**0.5
    w_down = torch.randn(case.num_experts, case.hidden, case.inter, generator=generator) / case.inter**0.5
    pool = torch.arange(case.num_experts) if case.chosen_experts is None else torch.tensor(case.chosen_experts)
    scores = torch.rand(case.num_tokens, pool.numel(), generator=generator)
    picks = scores.argsort(dim=-1)[:, : case.top_k]  # distinct experts per token, at random
    topk_ids = pool[picks]
    topk_weights = torch.rand(case.num_tokens, case.top_k, generator=generator)
    return tuple(t.to(case.dtype) if t.is_floating_point() else t
                 for t in (hidden, w_gate_up, w_down, topk_weights, topk_ids))


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fused_moe_matches_cpu_path(case: Case) -> None:
    inputs = make_inputs(case)
    expected = fused_moe_ref(*(t.float() if t.is_floating_point() else t for t in inputs))
    actual = fused_moe_with_tiles(*inputs, case.tiles)
    assert actual.dtype == case.dtype and actual.shape == (case.num_tokens, case.hidden)
    torch.testing.assert_close(actual.float(), expected, atol=TOLERANCE[case.dtype], rtol=0)


def test_default_tiles_and_int32_ids() -> None:
    hidden, w_gate_up, w_down, topk_weights, topk_ids = make_inputs(Case(9, 24, 20, 5, 2, MoeTiles(16, 16, 16)))
    expected = fused_moe_ref(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    actual = fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids.to(torch.int32))
    torch.testing.assert_close(actual, expected, atol=TOLERANCE[torch.float32], rtol=0)


def test_cpu_path_equals_dense_per_token_sum() -> None:
    """The grouped CPU path against the definition: every token through each of its experts, weighted."""
    hidden, w_gate_up, w_down, topk_weights, topk_ids = make_inputs(Case(7, 16, 12, 5, 3, MoeTiles(16, 16, 16)))
    expected = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for weight, expert in zip(topk_weights[token], topk_ids[token]):
            gate, up = (w_gate_up[expert] @ hidden[token]).chunk(2)
            expected[token] += weight * (w_down[expert] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_moe_ref(hidden, w_gate_up, w_down, topk_weights, topk_ids), expected,
                               atol=1e-5, rtol=0)


def test_no_tokens_gives_an_empty_result() -> None:
    hidden, w_gate_up, w_down, topk_weights, topk_ids = make_inputs(Case(0, 16, 12, 4, 2, MoeTiles(16, 16, 16)))
    for moe in (fused_moe, fused_moe_ref):
        assert moe(hidden, w_gate_up, w_down, topk_weights, topk_ids).shape == (0, 16)


@pytest.mark.parametrize("num_experts,top_k,num_tokens,block_m", [(4, 1, 13, 16), (7, 2, 37, 16), (64, 8, 3, 32)])
def test_alignment_groups_every_routed_row_once_per_padded_expert_block(num_experts: int, top_k: int,
                                                                        num_tokens: int, block_m: int) -> None:
    generator = torch.Generator().manual_seed(num_experts)
    topk_ids = torch.rand(num_tokens, num_experts, generator=generator).argsort(dim=-1)[:, :top_k]
    aligned = align_tokens_by_expert(topk_ids, num_experts, block_m)
    num_rows = num_tokens * top_k
    used = int(aligned.num_padded)
    assert used % block_m == 0 and aligned.sorted_rows.numel() % block_m == 0
    rows = aligned.sorted_rows[:used]
    real = rows[rows < num_rows]
    assert sorted(real.tolist()) == list(range(num_rows))  # every routed row exactly once
    assert bool((aligned.sorted_rows[used:] == num_rows).all())  # the spare tail is all padding
    flat = topk_ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    for block in range(used // block_m):
        tile = rows[block * block_m : (block + 1) * block_m]
        experts = flat[tile[tile < num_rows].long()]
        assert experts.numel() > 0  # no all-padding block for an expert without tokens
        assert bool((experts == aligned.block_experts[block]).all())


@pytest.mark.parametrize("moe", [fused_moe, fused_moe_ref], ids=["triton", "reference"])
def test_mismatched_inputs_are_named(moe) -> None:  # type: ignore[no-untyped-def]
    hidden, w_gate_up, w_down, topk_weights, topk_ids = make_inputs(Case(3, 16, 12, 4, 2, MoeTiles(16, 16, 16)))
    with pytest.raises(ValueError, match="w_down"):
        moe(hidden, w_gate_up, w_down[:, :, :-1], topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk_ids"):
        moe(hidden, w_gate_up, w_down, topk_weights, topk_ids.float())
    with pytest.raises(ValueError, match="hidden"):
        moe(hidden[:, :-1], w_gate_up, w_down, topk_weights, topk_ids)
