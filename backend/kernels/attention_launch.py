"""Host side of the unified paged attention kernel: validation, tiling, launch."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedllm.kernels.attention_heuristics import AttentionTiles, next_power_of_two, plan_attention
from pagedllm.kernels.attention_kernel import reduce_splits_kernel, unified_attention_kernel
from pagedllm.kernels.launch_support import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    is_interpreted,
    num_sms,
    require_dtype,
    require_ndim,
    require_same_device,
    runnable,
)
from pagedllm.kernels.kv_write import kv_scale_or_one
from pagedllm.kernels.reference import FP8_DTYPES

MAX_HEAD_DIM = 256
LOG2_E = math.log2(math.e)


def unified_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_table: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit k_cache's scale (None: 1.0)
    v_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit v_cache's scale (None: 1.0)
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    Same contract as :func:`pagedllm.kernels.reference.unified_attention_ref`;
    split-KV is chosen by :func:`pagedllm.kernels.attention_heuristics.num_kv_splits`.
    Shapes and dtypes are checked; the index values are trusted, since reading
    them would synchronise with the GPU: ``query_start_loc`` must rise from 0 to
    ``num_tokens``, each query length must not exceed its ``seq_lens`` entry, and
    every block a sequence uses must be in its ``block_table`` row. A model runs
    :func:`plan_unified_attention` once per step and :func:`unified_attention_planned`
    per layer instead, so the checks, tiling and buffers are not redone per layer.
    """
    return unified_attention_with_splits(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, out,
                                         k_scale=k_scale, v_scale=v_scale)


def unified_attention_with_splits(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_table: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`unified_attention` with the split-KV choice exposed: ``None`` = heuristic,
    1 = single pass, ``n > 1`` = flash-decoding with ``n`` key slices (any batch)."""
    step = plan_unified_attention(query_start_loc, seq_lens, block_table)
    return unified_attention_planned(q, k_cache, v_cache, step, scale, out, num_splits, k_scale, v_scale)


@dataclass(frozen=True, slots=True)
class _Launch:
    """Everything a layer's launch needs that depends only on shapes: tiles, grid, split-KV buffers."""

    tiles: AttentionTiles
    grid: tuple[int, int, int]
    # Split-KV partials (acc [num_tokens, num_heads, num_splits, head_pad], running max and sum
    # [num_tokens, num_heads, num_splits], fp32); None for a single pass.
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


_LaunchKey = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class AttentionStepPlan:
    """One step's checked index tensors, and the launch of each layer geometry seen so far.

    Every layer of a model has the same shapes, so the first layer plans the
    launch (checks shapes, picks tiles, allocates split-KV partials) and the
    others reuse it: the layers run one after another, so they can share the partials.
    """

    query_start_loc: torch.Tensor  # contiguous int [num_seqs + 1]
    seq_lens: torch.Tensor  # contiguous int [num_seqs]
    block_table: torch.Tensor  # int [num_seqs, max_blocks_per_seq]
    launches: dict[_LaunchKey, _Launch] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()


def plan_unified_attention(
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_table: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
) -> AttentionStepPlan:
    """Check a step's layout once; pass the result to :func:`unified_attention_planned` in every layer."""
    _validate_layout(query_start_loc, seq_lens, block_table)
    # The kernel indexes these 1-D tensors densely; a no-op for the usual contiguous ones.
    return AttentionStepPlan(query_start_loc.contiguous(), seq_lens.contiguous(), block_table)


def unified_attention_planned(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    step: object,  # the AttentionStepPlan of this step
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit k_cache's scale (None: 1.0)
    v_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit v_cache's scale (None: 1.0)
) -> torch.Tensor:
    """:func:`unified_attention_with_splits` for a step planned by :func:`plan_unified_attention`."""
    if not isinstance(step, AttentionStepPlan):
        raise ValueError(f"step must be the AttentionStepPlan of plan_unified_attention, got {type(step).__name__}")
    launch = _planned_launch(q, k_cache, v_cache, step, num_splits)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}, "
                         f"expected {q.dtype} {tuple(q.shape)} on {q.device}")
    if launch is None:
        return out
    tiles = launch.tiles
    # A single pass writes only ``out``; the kernel still takes the partials' pointers.
    part_acc, part_max, part_sum = (out, out, out) if launch.partials is None else launch.partials
    kernel = runnable(unified_attention_kernel, q.device)
    upcast = q.dtype == torch.float32 or is_interpreted(kernel)
    quant = k_cache.dtype in FP8_DTYPES
    if quant:
        k_scale, v_scale = kv_scale_or_one(k_scale, q.device), kv_scale_or_one(v_scale, q.device)
    kernel[launch.grid](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum,
        step.query_start_loc, step.seq_lens, step.block_table, k_scale if quant else q, v_scale if quant else q,
        float(scale) * LOG2_E, step.num_seqs, q.shape[1],
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *step.block_table.stride(),
        HEAD_DIM=q.shape[2], HEAD_PAD=tiles.head_pad, GROUP=tiles.group, GROUP_PAD=tiles.group_pad,
        BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n, BLOCK_SIZE=k_cache.shape[1],
        NUM_SPLITS=tiles.num_splits, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32", KV_QUANT=quant,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if launch.partials is not None:
        _reduce(out, *launch.partials, tiles)
    return out


def _planned_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: AttentionStepPlan,
    num_splits: int | None,
) -> _Launch | None:
    """The step's launch for these shapes, planned on first use; ``None`` for an empty batch."""
    key = (tuple(q.shape), q.dtype, q.device, tuple(k_cache.shape), k_cache.dtype, tuple(v_cache.shape),
           v_cache.dtype, num_splits)
    if key in step.launches:
        return step.launches[key]
    _validate_geometry(q, k_cache, v_cache, step, num_splits)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0:
        return None
    max_context = step.block_table.shape[1] * block_size
    tiles = plan_attention(num_tokens, step.num_seqs, num_heads, num_kv_heads, head_dim, max_context,
                           num_sms(q.device), q.element_size(), num_splits)
    partials = None
    if tiles.num_splits > 1:
        part_max = torch.empty(num_tokens, num_heads, tiles.num_splits, dtype=torch.float32, device=q.device)
        partials = (torch.empty(num_tokens, num_heads, tiles.num_splits, tiles.head_pad, dtype=torch.float32,
                                device=q.device), part_max, torch.empty_like(part_max))
    launch = _Launch(
        tiles=tiles,
        grid=(num_tokens // tiles.block_q + step.num_seqs, num_kv_heads, tiles.num_splits),
        partials=partials,
    )
    step.launches[key] = launch
    return launch


def _reduce(
    out: torch.Tensor,
    part_acc: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    tiles: AttentionTiles,
) -> None:
    num_tokens, num_heads, head_dim = out.shape
    runnable(reduce_splits_kernel, out.device)[(num_tokens, num_heads)](
        out, part_acc, part_max, part_sum, num_heads, *out.stride(),
        HEAD_DIM=head_dim, HEAD_PAD=tiles.head_pad,
        NUM_SPLITS=tiles.num_splits, SPLITS_PAD=next_power_of_two(tiles.num_splits),
    )


def _validate_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> None:
    require_ndim("query_start_loc", query_start_loc, 1)
    require_ndim("seq_lens", seq_lens, 1)
    require_ndim("block_table", block_table, 2)
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        require_dtype(name, tensor, INDEX_DTYPES)
    num_seqs = seq_lens.numel()
    if query_start_loc.numel() != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.numel()} entries, expected num_seqs + 1 = {num_seqs + 1}")
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected num_seqs = {num_seqs}")
    require_same_device(seq_lens.device, query_start_loc=query_start_loc, block_table=block_table)


def _validate_geometry(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: AttentionStepPlan,
    num_splits: int | None,
) -> None:
    require_ndim("q", q, 3)
    require_ndim("k_cache", k_cache, 4)
    require_dtype("q", q, FLOAT_DTYPES)
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in (q.dtype, *FP8_DTYPES):
        raise ValueError(f"k_cache/v_cache dtypes {k_cache.dtype}/{v_cache.dtype} must both be q's {q.dtype} "
                         "or both one 8-bit format")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} differs from q head_dim {head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q head_dim {head_dim} is outside [1, {MAX_HEAD_DIM}]")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"q num_heads {num_heads} is not a multiple of k_cache num_kv_heads {num_kv_heads}")
    if num_tokens > 0 and step.num_seqs == 0:
        raise ValueError(f"seq_lens is empty but q has {num_tokens} tokens")
    if num_tokens > 0 and step.block_table.shape[1] == 0:
        raise ValueError("block_table has no columns but the batch has tokens")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    require_same_device(q.device, k_cache=k_cache, v_cache=v_cache, seq_lens=step.seq_lens)
