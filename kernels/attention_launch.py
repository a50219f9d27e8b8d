"""Host side of the unified paged attention kernel: validation, tiling, launch."""
from __future__ import annotations

import math

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
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    Same contract as :func:`pagedllm.kernels.reference.unified_attention_ref`;
    split-KV is chosen by :func:`pagedllm.kernels.attention_heuristics.num_kv_splits`.
    Shapes and dtypes are checked; the index values are trusted, since reading
    them would synchronise with the GPU: ``query_start_loc`` must rise from 0 to
    ``num_tokens``, each query length must not exceed its ``seq_lens`` entry, and
    every block a sequence uses must be in its ``block_table`` row.
    """
    return unified_attention_with_splits(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, out)


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
) -> torch.Tensor:
    """:func:`unified_attention` with the split-KV choice exposed: ``None`` = heuristic,
    1 = single pass, ``n > 1`` = flash-decoding with ``n`` key slices (any batch)."""
    _validate(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, out, num_splits)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.numel()
    # The kernel indexes these 1-D tensors densely; a no-op for the usual contiguous ones.
    query_start_loc = query_start_loc.contiguous()
    seq_lens = seq_lens.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    max_context = block_table.shape[1] * block_size
    tiles = plan_attention(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, max_context,
                           num_sms(q.device), q.element_size(), num_splits)
    tiles_per_split = max(1, _cdiv(_cdiv(max_context, tiles.tile_n), tiles.num_splits))
    if tiles.num_splits == 1:
        part_acc = part_max = part_sum = out
    else:
        part_acc = torch.empty(num_tokens, num_heads, tiles.num_splits, tiles.head_pad,
                               dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_tokens, num_heads, tiles.num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    kernel = runnable(unified_attention_kernel, q.device)
    upcast = q.dtype == torch.float32 or is_interpreted(kernel)
    grid = (num_tokens // tiles.block_q + num_seqs, num_kv_heads, tiles.num_splits)
    kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum,
        query_start_loc, seq_lens, block_table,
        float(scale) * LOG2_E, num_seqs, num_heads, tiles_per_split,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(),
        HEAD_DIM=head_dim, HEAD_PAD=tiles.head_pad, GROUP=tiles.group, GROUP_PAD=tiles.group_pad,
        BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=tiles.num_splits, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32",
        num_warps=tiles.num_warps,
    )
    if tiles.num_splits > 1:
        _reduce(out, part_acc, part_max, part_sum, tiles)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


def _validate(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor | None,
    num_splits: int | None,
) -> None:
    require_ndim("q", q, 3)
    require_ndim("k_cache", k_cache, 4)
    require_ndim("query_start_loc", query_start_loc, 1)
    require_ndim("seq_lens", seq_lens, 1)
    require_ndim("block_table", block_table, 2)
    require_dtype("q", q, FLOAT_DTYPES)
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        require_dtype(name, tensor, INDEX_DTYPES)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache dtypes {k_cache.dtype}/{v_cache.dtype} must match q's {q.dtype}")
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
    num_seqs = seq_lens.numel()
    if query_start_loc.numel() != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.numel()} entries, expected num_seqs + 1 = {num_seqs + 1}")
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected num_seqs = {num_seqs}")
    if num_tokens > 0 and num_seqs == 0:
        raise ValueError(f"seq_lens is empty but q has {num_tokens} tokens")
    if num_tokens > 0 and block_table.shape[1] == 0:
        raise ValueError("block_table has no columns but the batch has tokens")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)}, expected {q.dtype} {tuple(q.shape)}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    require_same_device(q.device, k_cache=k_cache, v_cache=v_cache, query_start_loc=query_start_loc,
                        seq_lens=seq_lens, block_table=block_table, **({} if out is None else {"out": out}))
