"""Triton-lang unified attention against the torch reference.

CPU tensors always run in triton's interpreter (no TRITON_INTERPRET needed).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from pagedllm.kernels import unified_attention, unified_attention_ref
from pagedllm.kernels.attention_heuristics import MAX_SPLITS, num_kv_splits, plan_attention
from pagedllm.kernels.attention_launch import (
    plan_unified_attention,
    unified_attention_planned,
    unified_attention_with_splits,
)
from pagedllm.testing.paged_batch import PagedBatch, random_paged_batch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True, slots=True)
class Case:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32
    num_splits: int | None = 1


def make_batch(case: Case, seed: int = 0, spare_columns: int = 1) -> PagedBatch:
    return random_paged_batch(case.query_lens, case.seq_lens, case.num_heads, case.num_kv_heads, case.head_dim,
                              case.block_size, case.dtype, generator=torch.Generator().manual_seed(seed),
                              spare_columns=spare_columns)


CASES = {
    # decode only: one new token per sequence; contexts cross block and key-tile edges
    "decode-gqa4-d64-b16": Case((1, 1, 1), (1, 17, 70), 8, 2, 64, 16),
    "decode-gqa4-d64-b16-split4": Case((1, 1, 1), (1, 17, 70), 8, 2, 64, 16, num_splits=4),
    "decode-gqa8-d128-b32-split2-fp16": Case((1, 1), (33, 90), 8, 1, 128, 32, torch.float16, num_splits=2),
    # prefill only: whole prompts, longer than one query block
    "prefill-gqa1-d128-b32": Case((21, 5), (21, 5), 2, 2, 128, 32),
    "prefill-gqa4-d64-b16-fp16": Case((19, 3), (19, 3), 4, 1, 64, 16, torch.float16),
    # mixed: a decode, a chunk that starts mid-sequence, a first chunk
    "mixed-gqa8-d96-b16": Case((1, 6, 4), (40, 22, 4), 8, 1, 96, 16),
    "mixed-gqa8-d96-b16-split3": Case((1, 6, 4), (40, 22, 4), 8, 1, 96, 16, num_splits=3),
    "mixed-gqa4-d80-b32-fp16": Case((5, 1, 18), (12, 50, 30), 4, 1, 80, 32, torch.float16),
    "mixed-gqa3-d64-b8": Case((1, 9), (26, 20), 6, 2, 64, 8),
    "mixed-gqa4-d64-b16-bf16": Case((1, 7), (30, 15), 4, 1, 64, 16, torch.bfloat16),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_unified_attention_matches_reference(case: Case) -> None:
    batch = make_batch(case)
    expected = unified_attention_ref(*batch.args())
    actual = unified_attention_with_splits(*batch.args(), num_splits=case.num_splits)
    assert actual.dtype == case.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[case.dtype], rtol=0)


def test_public_entry_point_handles_strided_inputs_and_preallocated_out() -> None:
    """q as a view of a fused projection (row stride > heads * dim), a column-major block table."""
    case = Case((1, 3), (40, 3), 4, 2, 64, 16)
    batch = make_batch(case)
    fused = torch.randn(sum(case.query_lens), 2 * case.num_heads * case.head_dim)
    q = fused[:, : case.num_heads * case.head_dim].view(-1, case.num_heads, case.head_dim)
    block_table = batch.block_table.t().contiguous().t()
    assert block_table.stride(1) != 1
    args = (q, *batch.args()[1:5], block_table, batch.scale)
    out = torch.full_like(q, float("nan"))
    result = unified_attention(*args, out=out)
    assert result is out
    torch.testing.assert_close(out, unified_attention_ref(*args), atol=1e-5, rtol=0)


def test_split_kv_agrees_with_single_pass_on_a_heuristic_shape() -> None:
    case = Case((1, 1), (600, 45), 4, 1, 32, 16)
    batch = make_batch(case, spare_columns=0)
    max_context = batch.block_table.shape[1] * case.block_size
    splits = plan_attention(2, 2, 4, 1, 32, max_context, num_sms=8).num_splits
    assert splits > 1
    single = unified_attention_with_splits(*batch.args(), num_splits=1)
    split = unified_attention_with_splits(*batch.args(), num_splits=splits)
    torch.testing.assert_close(split, single, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_one_step_plan_serves_every_layer(num_splits: int) -> None:
    """The launch is planned at the first layer (tiles, split partials) and reused by the next ones."""
    case = Case((1, 1, 1), (1, 40, 70), 8, 2, 64, 16)
    batch = make_batch(case)
    step = plan_unified_attention(batch.query_start_loc, batch.seq_lens, batch.block_table)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        q, k_cache, v_cache = (torch.randn(t.shape, generator=generator) for t in (batch.q, batch.k_cache, batch.v_cache))
        actual = unified_attention_planned(q, k_cache, v_cache, step, batch.scale, num_splits=num_splits)
        expected = unified_attention_ref(q, k_cache, v_cache, *batch.args()[3:])
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    (launch,) = step.launches.values()
    assert launch.tiles.num_splits == num_splits and (launch.partials is None) == (num_splits == 1)


def test_planned_launch_refuses_a_foreign_plan() -> None:
    batch = make_batch(Case((1,), (5,), 2, 1, 64, 16))
    with pytest.raises(ValueError, match="AttentionStepPlan"):
        unified_attention_planned(batch.q, batch.k_cache, batch.v_cache, None, batch.scale)


def test_split_heuristic_splits_only_small_long_decode_batches() -> None:
    h200_sms = 132
    few_long = num_kv_splits(num_seqs=1, num_tokens=1, num_kv_heads=8, max_context=32768, num_sms=h200_sms)
    assert 1 < few_long <= MAX_SPLITS and few_long * 8 >= h200_sms  # one program per SM, not a power of two
    assert num_kv_splits(num_seqs=1, num_tokens=1, num_kv_heads=8, max_context=512, num_sms=h200_sms) == 2
    assert num_kv_splits(num_seqs=1, num_tokens=1, num_kv_heads=8, max_context=256, num_sms=h200_sms) == 1
    assert num_kv_splits(num_seqs=256, num_tokens=256, num_kv_heads=8, max_context=32768, num_sms=h200_sms) == 1
    assert num_kv_splits(num_seqs=2, num_tokens=700, num_kv_heads=8, max_context=32768, num_sms=h200_sms) == 1


def test_plan_pads_head_dim_and_group_and_keeps_dot_dims_at_least_16() -> None:
    decode = plan_attention(num_tokens=4, num_seqs=4, num_heads=14, num_kv_heads=2, head_dim=80,
                            max_context=64, num_sms=1)
    assert (decode.head_pad, decode.group, decode.group_pad) == (128, 7, 8)
    assert decode.block_m == decode.block_q * decode.group_pad >= 16
    prefill = plan_attention(num_tokens=300, num_seqs=2, num_heads=32, num_kv_heads=32, head_dim=256,
                             max_context=512, num_sms=1)
    assert prefill.block_q > decode.block_q and prefill.tile_n >= 16 and prefill.num_splits == 1


def test_empty_batch_returns_without_launching() -> None:
    batch = make_batch(Case((1,), (5,), 2, 1, 64, 16))
    q = batch.q[:0]
    out = unified_attention(q, batch.k_cache, batch.v_cache, torch.zeros(1, dtype=torch.int32),
                            torch.zeros(0, dtype=torch.int32), batch.block_table[:0], batch.scale)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("num_heads", lambda b: {"q": b.q[:, :3]}),
        ("head_dim", lambda b: {"q": b.q[..., :32]}),
        ("query_start_loc", lambda b: {"query_start_loc": b.query_start_loc[:-1]}),
        ("block_table", lambda b: {"block_table": b.block_table[:1]}),
        ("seq_lens", lambda b: {"seq_lens": b.seq_lens.float()}),
        ("v_cache", lambda b: {"v_cache": b.v_cache[:, :8]}),
        ("dtypes", lambda b: {"k_cache": b.k_cache.half()}),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(
    field: str, change: Callable[[PagedBatch], dict[str, torch.Tensor]]
) -> None:
    batch = make_batch(Case((1, 2), (4, 2), 4, 2, 64, 16))
    args = dict(zip(("q", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_table", "scale"), batch.args()))
    args.update(change(batch))
    with pytest.raises(ValueError, match=field):
        unified_attention(**args)
