"""The production plain-torch attention backend against the reference oracle."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from pagedllm.kernels import unified_attention_ref, write_kv_ref
from pagedllm.testing.paged_batch import PagedBatch, random_paged_batch
from pagedllm.attention.backends import (
    BACKEND_NAMES,
    REFERENCE_BACKEND,
    attention_backend_named,
    select_attention_backend,
    torch_backend,
)
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.cpu_attention import attention_with_lse, math_attention_with_lse, new_cpu_cache
from pagedllm.attention.cpu_attention_plan import DECODE_BATCH_FILL, MIN_SHARED_PREFIX_BLOCKS, CpuAttentionPlan
from pagedllm.attention.native_decode import load_native_decode

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True, slots=True)
class Case:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32


CASES = {
    # decodes only, in one padded batch; contexts end mid-block and on a block edge
    "decode-gqa4-d64-b16": Case((1, 1, 1, 1), (20, 17, 32, 30), 8, 2, 64, 16),
    # long-tail decodes: split into several batches of similar length, queries reordered
    "decode-longtail-gqa8-d128-b16": Case((1,) * 6, (300, 3, 700, 33, 35, 160), 8, 1, 128, 16),
    # prefill only: whole prompts and a chunk starting mid-sequence
    "prefill-gqa1-d128-b32": Case((21, 5, 7), (21, 5, 40), 2, 2, 128, 32),
    # mixed prefill chunks and decodes of very different lengths
    "mixed-gqa8-d96-b16": Case((1, 6, 4, 1), (40, 22, 4, 200), 8, 1, 96, 16),
    "mixed-gqa4-d80-b32": Case((5, 1, 18, 1), (12, 50, 30, 3), 4, 1, 80, 32),
    "mixed-gqa1-d64-b16": Case((1, 9, 1), (26, 20, 130), 4, 4, 64, 16),
    "mixed-gqa4-d64-b16-bf16": Case((1, 7, 1), (30, 15, 90), 8, 2, 64, 16, torch.bfloat16),
    # bf16 decodes only: the compiled routine reads a head-major bf16 cache in place
    "decode-gqa7-d64-b16-bf16": Case((1, 1, 1), (30, 16, 90), 14, 2, 64, 16, torch.bfloat16),
}


def make_batch(case: Case, seed: int = 0) -> PagedBatch:
    # A spare block-table column pointing elsewhere, as a runner's padded rows have.
    return random_paged_batch(case.query_lens, case.seq_lens, case.num_heads, case.num_kv_heads, case.head_dim,
                              case.block_size, case.dtype, generator=torch.Generator().manual_seed(seed),
                              spare_columns=1)


def metadata_of(batch: PagedBatch) -> AttentionMetadata:
    query_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    return AttentionMetadata(
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=int(batch.seq_lens.max()),
    )


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in the engine's CPU cache layout."""
    stored = new_cpu_cache(tuple(cache.shape), cache.dtype, cache.device)
    assert stored.permute(2, 0, 1, 3).is_contiguous()
    return stored.copy_(cache)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
@pytest.mark.parametrize("layout", ["head-major", "contiguous"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_torch_backend_matches_reference(case: Case, layout: str, native: bool) -> None:
    batch = make_batch(case)
    if layout == "head-major":
        batch = replace(batch, k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache))
    backend = torch_backend(native=native)
    actual = backend.attend(batch.q, batch.k_cache, batch.v_cache, backend.plan(metadata_of(batch)), batch.scale)
    expected = unified_attention_ref(*batch.args())
    assert actual.shape == batch.q.shape and actual.dtype == case.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[case.dtype], rtol=0)


def test_one_plan_serves_every_layer_and_buffers_serve_every_step() -> None:
    """Layers differ in q and cache contents but share the step's plan; the next step reuses the buffers."""
    case = CASES["mixed-gqa8-d96-b16"]
    backend = torch_backend()
    first = make_batch(case, seed=1)
    planned = backend.plan(metadata_of(first))
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        layer = replace(first, **{name: torch.randn(getattr(first, name).shape, generator=generator)
                                  for name in ("q", "k_cache", "v_cache")})
        actual = backend.attend(layer.q, layer.k_cache, layer.v_cache, planned, layer.scale)
        torch.testing.assert_close(actual, unified_attention_ref(*layer.args()), atol=1e-5, rtol=0)
    assert isinstance(planned.plan, CpuAttentionPlan) and len(planned.plan.layouts) == 1
    next_step = make_batch(CASES["decode-longtail-gqa8-d128-b16"], seed=4)
    actual = backend.attend(next_step.q, next_step.k_cache, next_step.v_cache, backend.plan(metadata_of(next_step)),
                            next_step.scale)
    torch.testing.assert_close(actual, unified_attention_ref(*next_step.args()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
def test_padding_beyond_each_context_is_never_attended(native: bool) -> None:
    """Slots past a sequence's end hold huge values; a leak would swamp the output."""
    case = CASES["mixed-gqa4-d80-b32"]
    batch = make_batch(case)
    k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
    for row, length in enumerate(case.seq_lens):
        last_block = int(batch.block_table[row, (length - 1) // case.block_size])
        k_cache[last_block, (length - 1) % case.block_size + 1 :] = 1e4
        v_cache[last_block, (length - 1) % case.block_size + 1 :] = 1e4
    backend = torch_backend(native=native)
    actual = backend.attend(batch.q, k_cache, v_cache, backend.plan(metadata_of(batch)), batch.scale)
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=1e-5, rtol=0)


def test_unplanned_metadata_is_refused() -> None:
    batch = make_batch(CASES["decode-gqa4-d64-b16"])
    with pytest.raises(ValueError, match=r"plan\(metadata\) once per step"):
        torch_backend().attend(batch.q, batch.k_cache, batch.v_cache, metadata_of(batch), batch.scale)


def test_backends_by_name_and_by_device() -> None:
    assert [attention_backend_named(name).name for name in BACKEND_NAMES] == list(BACKEND_NAMES)
    assert attention_backend_named("torch-reference") is REFERENCE_BACKEND
    assert select_attention_backend(torch.device("cpu"), use_triton=False).name == "torch"
    with pytest.raises(ValueError, match="'flash' is not one of torch, triton, torch-reference"):
        attention_backend_named("flash")


def test_without_the_native_routine_decodes_batch_by_similar_length_and_prefills_attend_alone() -> None:
    case = CASES["decode-longtail-gqa8-d128-b16"]
    planned = torch_backend().plan(metadata_of(make_batch(case))).plan
    assert isinstance(planned, CpuAttentionPlan)
    layout = planned.layout(case.block_size, case.dtype, native=False)
    blocks = [-(-length // case.block_size) for length in case.seq_lens]
    members = sorted(int(token) for batch in layout.decodes for token in batch.tokens)
    assert members == list(range(len(case.seq_lens))) and len(layout.decodes) > 1 and not layout.prefills
    for batch in layout.decodes:
        widths = [blocks[int(token)] for token in batch.tokens]
        assert batch.blocks_per_seq == max(widths) and min(widths) >= DECODE_BATCH_FILL * max(widths)
    assert not layout.decodes_in_order

    alike = CASES["decode-gqa4-d64-b16"]
    layout = torch_backend().plan(metadata_of(make_batch(alike))).plan.layout(alike.block_size, alike.dtype, False)
    assert layout.decodes_in_order and len(layout.decodes) == 1

    mixed = CASES["mixed-gqa8-d96-b16"]
    layout = torch_backend().plan(metadata_of(make_batch(mixed))).plan.layout(mixed.block_size, mixed.dtype, False)
    assert [(chunk.start, chunk.query_len, chunk.seq_len) for chunk in layout.prefills] == [(1, 6, 22), (7, 4, 4)]
    # A chunk after earlier context is masked; a whole prompt uses SDPA's own causal mode.
    assert [chunk.mask is None for chunk in layout.prefills] == [False, True]
    assert sorted(int(token) for batch in layout.decodes for token in batch.tokens) == [0, 11]


def sharing_batch(dtype: torch.dtype) -> PagedBatch:
    """Decodes 0-3 start with the same 6 blocks (as prefix caching leaves them), decode 4 shares its first
    block with 5 only, sequence 5 is a prefill chunk, and decode 6 shares nothing; block 16, 8 KV heads."""
    case = Case((1, 1, 1, 1, 1, 9, 1), (97, 120, 200, 113, 70, 60, 150), 8, 2, 64, 16, dtype)
    batch = make_batch(case, seed=3)
    table = batch.block_table.clone()
    table[1:4, :6] = table[0, :6]
    table[5, 0] = table[4, 0]
    return replace(batch, block_table=table, k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_sharing_a_prefix_attend_to_it_once_and_match_the_reference(dtype: torch.dtype, native: bool) -> None:
    batch = sharing_batch(dtype)
    backend = torch_backend(native=native)
    planned = backend.plan(metadata_of(batch))
    in_place = native and dtype == torch.float32 and load_native_decode() is not None
    layout = planned.plan.layout(16, dtype, in_place)
    if in_place:
        # The compiled routine reads the shared blocks in place, once per sharer: no cascade.
        assert not layout.shared_prefixes and layout.native_decodes is not None
        decodes = layout.native_decodes
        by_row = dict(zip(decodes.rows.tolist(), decodes.lens.tolist()))
        assert [by_row[row] for row in sorted(by_row)] == [97, 120, 200, 113, 70, 150]
        assert decodes.lens.tolist() == [by_row[row] for row in decodes.rows.tolist()]
    else:
        # Only 0-3 form a group (4 and 5 share one block, and 5 is not decoding); the shared
        # part stops before the shortest member's newest token.
        assert [(sorted(p.tokens.tolist()), p.num_blocks) for p in layout.shared_prefixes] == [([0, 1, 2, 3], 6)]
        assert 6 >= MIN_SHARED_PREFIX_BLOCKS and not layout.decodes_in_order
    actual = backend.attend(batch.q, batch.k_cache, batch.v_cache, planned, batch.scale)
    expected = unified_attention_ref(*batch.args())
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


def test_the_compiled_routine_attends_the_sharers_of_a_prefix_one_after_another() -> None:
    """Two cached prefixes whose sharers arrived interleaved (A B A B A B): the routine's order groups each
    prefix's sharers, and the result is still every query row's own."""
    case = Case((1,) * 6, (80, 90, 100, 110, 120, 130), 8, 2, 64, 16, torch.float32)
    batch = make_batch(case, seed=5)
    table = batch.block_table.clone()
    table[2::2, :4] = table[0, :4]
    table[3::2, :4] = table[1, :4]
    batch = replace(batch, block_table=table, k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache))
    backend = torch_backend(native=True)
    planned = backend.plan(metadata_of(batch))
    if load_native_decode() is None:
        pytest.skip("the compiled decode routine cannot be built here")
    decodes = planned.plan.layout(16, torch.float32, True).native_decodes
    assert decodes is not None
    firsts = decodes.block_table[:, 0].tolist()
    assert firsts.count(firsts[0]) == 3 and firsts[:3] == [firsts[0]] * 3 and firsts[3:] == [firsts[3]] * 3
    assert sorted(decodes.rows.tolist()) == list(range(6))
    actual = backend.attend(batch.q, batch.k_cache, batch.v_cache, planned, batch.scale)
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=TOLERANCE[torch.float32], rtol=0)


def test_the_log_sum_exp_off_cpu_is_the_flash_kernels() -> None:
    """The formula other devices use gives what the CPU flash kernel gives, masked rows included."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(shape, generator=generator) for shape in ((3, 2, 4, 16), (3, 2, 40, 16), (3, 2, 40, 16)))
    mask = torch.zeros(3, 1, 1, 40)
    mask[1, ..., 25:] = float("-inf")
    for attn_mask in (None, mask):
        (out, lse), (want_out, want_lse) = (f(q, k, v, attn_mask, 0.25)
                                            for f in (math_attention_with_lse, attention_with_lse))
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=0)


def test_a_prefix_ending_at_a_members_newest_token_is_shared_only_before_it() -> None:
    """A member whose newest token sits in the block after the shared ones keeps that block as its own."""
    batch = sharing_batch(torch.float32)
    seq_lens = batch.seq_lens.clone()
    seq_lens[0] = 5 * 16 + 1  # its newest token opens block 5, which the others share
    batch = replace(batch, seq_lens=seq_lens)
    backend = torch_backend(native=False)
    planned = backend.plan(metadata_of(batch))
    assert [p.num_blocks for p in planned.plan.layout(16, torch.float32, False).shared_prefixes] == [5]
    actual = backend.attend(batch.q, batch.k_cache, batch.v_cache, planned, batch.scale)
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=1e-5, rtol=0)


def test_an_empty_batch_attends_to_nothing() -> None:
    batch = make_batch(CASES["decode-gqa4-d64-b16"])
    empty = AttentionMetadata(torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                              batch.block_table[:0], torch.zeros(0, dtype=torch.int64), 0, 0)
    backend = torch_backend()
    out = backend.attend(batch.q[:0], batch.k_cache, batch.v_cache, backend.plan(empty), batch.scale)
    assert out.shape == (0, *batch.q.shape[1:])


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("slots", [[3, 40, 22, 0, 17], [3, -1, 22, 0, -1], []], ids=["all", "padded", "empty"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cpu_scatters_like_reference(slots: list[int], cache_dtype: torch.dtype, native: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    fused = torch.randn(len(slots), 3 * 2 * 24, generator=generator)  # strided views, as the qkv split gives
    key, value = fused[:, 48:96].view(-1, 2, 24), fused[:, 96:].view(-1, 2, 24)
    k_expected, v_expected = (torch.randn(6, 8, 2, 24, generator=generator).to(cache_dtype) for _ in range(2))
    k_cache, v_cache = head_major(k_expected), head_major(v_expected)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    write_kv_ref(key, value, k_expected, v_expected, slot_mapping)
    torch_backend(native).write_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
