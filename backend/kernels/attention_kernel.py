"""Triton-lang unified paged attention: one kernel for prefill chunks and decodes.

Grid: (query blocks, KV heads, KV splits). A program owns ``BLOCK_Q`` query
positions of one sequence times the ``GROUP`` query heads that share one KV
head (GQA packing), so every K/V tile it loads serves all of them. Keys are
read through the block table one key tile at a time, gathered per key, so the
paged block size is independent of the tile size. Softmax is online, in base 2,
accumulated in fp32. With ``NUM_SPLITS > 1`` each program covers a slice of
the keys and writes unnormalised partials that :func:`reduce_splits_kernel`
merges (flash-decoding).
"""
from __future__ import annotations

import triton
import triton.language as tl


# tl.max, tl.sum and tl.zeros are @triton.jit functions themselves, which a kernel run by the
# interpreter cannot call unless TRITON_INTERPRET was set before triton was first
# imported. Reducing with their combine functions works either way (and the
# interpreter still reduces these two with numpy).
_max = tl.standard._elementwise_max
_add = tl.standard._sum_combine


@triton.jit
def unified_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]; written only when NUM_SPLITS == 1
    part_acc_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD]; used when NUM_SPLITS > 1
    part_max_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS]; running max, base 2
    part_sum_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS]; softmax denominators
    query_start_loc_ptr,  # int [num_seqs + 1]
    seq_lens_ptr,  # int [num_seqs]
    block_table_ptr,  # int [num_seqs, max_blocks_per_seq]
    k_scale_ptr,  # fp32 [1]: an 8-bit k_cache's scale, read only when KV_QUANT
    v_scale_ptr,  # fp32 [1]: an 8-bit v_cache's scale, read only when KV_QUANT
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_bb,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32: fp32 inputs, and the interpreter (wrong bf16 arithmetic)
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,  # 8-bit K/V: converted to q's dtype as loaded, scales folded in (below)
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    # Sequence i's programs start at query_start_loc[i] // BLOCK_Q + i: an upper bound
    # on the query blocks before it, so the grid is sized on the host without reading
    # any lengths. Binary search for the last sequence starting at or before us.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    query_pos = q_block * BLOCK_Q + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (query_pos < query_len) & (head_in_group < GROUP)
    dim_valid = offs_d < HEAD_DIM
    token = q_start + query_pos
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    query_abs = context_len + query_pos
    if KV_QUANT:
        # q . (k8 * k_scale) = (q . k8) * k_scale, and sum p (v8 * v_scale) = v_scale * sum p v8:
        # one multiply per score and one per output row instead of one per loaded element.
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    # The last query of this block sees keys [0, kv_end); later keys are masked for all rows.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    num_tiles = (kv_end + TILE_N - 1) // TILE_N
    if NUM_SPLITS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        # Split s covers tiles [s * num_tiles // NUM_SPLITS, (s + 1) * num_tiles // NUM_SPLITS) of this
        # sequence's own keys: sizes differ by at most one tile, so a sequence shorter than the block table
        # (every one, under a CUDA graph's full-width table) still spreads over all the splits.
        tile_lo = split * num_tiles // NUM_SPLITS
        tile_hi = (split + 1) * num_tiles // NUM_SPLITS

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        key_valid = offs_n < kv_end
        block = tl.load(table_row + (offs_n // BLOCK_SIZE) * stride_bb, mask=key_valid, other=0).to(tl.int64)
        in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
        k_offs = (block[None, :] * stride_kb + in_block[None, :] * stride_ks
                  + kv_head * stride_kh + offs_d[:, None] * stride_kd)
        k = tl.load(k_cache_ptr + k_offs, mask=dim_valid[:, None] & key_valid[None, :], other=0.0)
        v_offs = (block[:, None] * stride_vb + in_block[:, None] * stride_vs
                  + kv_head * stride_vh + offs_d[None, :] * stride_vd)
        v = tl.load(v_cache_ptr + v_offs, mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_QUANT:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = key_valid[None, :] & (offs_n[None, :] <= query_abs[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
        # A row with nothing visible yet keeps max -inf; subtracting 0 instead avoids inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, _add)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if KV_QUANT:
        acc = acc * tl.load(v_scale_ptr)
    if NUM_SPLITS == 1:
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dim_valid[None, :])
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD]
    part_max_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS]
    part_sum_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS]
    num_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    split_valid = offs_s < NUM_SPLITS
    part = (token * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_max_ptr + part, mask=split_valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_valid, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], mask=split_valid[:, None], other=0.0)
    # Some split holds key 0, which every query sees, so the overall max is finite
    # and splits that saw no key (max -inf) get weight exp2(-inf) = 0.
    m_all = tl.reduce(m, 0, _max)
    weight = tl.exp2(m - m_all)
    total = tl.reduce(weight * l, 0, _add)
    result = tl.reduce(acc * weight[:, None], 0, _add) / total
    o_offs = token * stride_ot + head * stride_oh + offs_d * stride_od
    tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
