"""Plain-torch paged-attention references: the CPU path and the kernels' oracle.

Each function has exactly the signature of its Triton-lang twin in this package.
"""
from __future__ import annotations

import torch

# 8-bit KV cache formats: a cache of one of these dtypes holds ``clamp(x / scale)`` and reads back as
# ``stored * scale``, with one scale per layer for K and one for V (fp32 tensors of one element).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in ``dtype``, saturated at its largest finite value: out-of-range values never wrap to
    inf or NaN. Division in float32 and round-to-nearest-even, as the Triton-lang write does."""
    largest = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-largest, largest).to(dtype)


def dequantize_kv_ref(stored: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """What a quantized cache entry stands for, in ``dtype``."""
    return (stored.float() * scale).to(dtype)


def _readable(cache_rows: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as ``dtype``: dequantized for an 8-bit cache, as they are otherwise."""
    if cache_rows.dtype in FP8_DTYPES:
        return dequantize_kv_ref(cache_rows, 1.0 if scale is None else scale, dtype)
    return cache_rows


def unified_attention_ref(
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

    Sequences of similar context and query length are gathered into one padded
    batch each and handed to torch's fused ``scaled_dot_product_attention``
    (GQA without repeating K/V). Grouping keeps padding below ~2x even when a
    long-tail batch mixes 10-token and 1000-token contexts, at a handful of
    torch ops per group rather than per sequence.
    """
    starts = query_start_loc.to(device="cpu", dtype=torch.long)
    lens = seq_lens.to(device="cpu", dtype=torch.long)
    query_lens = starts[1:] - starts[:-1]
    result = torch.empty_like(q) if out is None else out
    for group in _similar_length_groups(query_lens, lens):
        _attend_padded(q, k_cache, v_cache, starts[group], query_lens[group], lens[group],
                       block_table[group.to(block_table.device)], scale, result, k_scale, v_scale)
    return result


def _similar_length_groups(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Indices of sequences whose lengths round to the same power of sqrt(2), per group."""
    def bucket(lengths: torch.Tensor) -> torch.Tensor:
        return torch.ceil(2 * torch.log2(lengths.clamp(min=1).double())).long()

    keys = bucket(seq_lens) * 1024 + bucket(query_lens)
    _, group_of = torch.unique(keys, return_inverse=True)
    order = torch.argsort(group_of, stable=True)
    counts = torch.bincount(group_of).tolist()
    return list(torch.split(order, counts))


def _attend_padded(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    starts: torch.Tensor,  # int64 [n] (cpu): first flat token of each sequence
    query_lens: torch.Tensor,  # int64 [n] (cpu)
    seq_lens: torch.Tensor,  # int64 [n] (cpu)
    block_table: torch.Tensor,  # int32 [n, max_blocks_per_seq]
    scale: float,
    result: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at these sequences' tokens
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    device = q.device
    num_seqs = seq_lens.numel()
    max_q = int(query_lens.max())
    max_s = int(seq_lens.max())

    row = torch.repeat_interleave(torch.arange(num_seqs), query_lens)
    index_in_seq = torch.arange(int(query_lens.sum())) - (torch.cumsum(query_lens, 0) - query_lens)[row]
    tokens = (starts[row] + index_in_seq).to(device)
    row, index_in_seq = row.to(device), index_in_seq.to(device)
    padded_q = q.new_zeros(num_seqs, num_heads, max_q, head_dim)
    padded_q[row, :, index_in_seq] = q[tokens]

    lens = seq_lens.to(device)
    key_pos = torch.arange(max_s, device=device)
    blocks = block_table.to(device=device, dtype=torch.long)[:, key_pos // block_size]
    slots = blocks * block_size + key_pos % block_size  # [num_seqs, max_s]
    # Slots past a sequence's end are masked out below; they must hold finite values
    # (the runner zero-fills the cache, and only finite K/V are ever written).
    keys = _readable(k_cache.reshape(-1, num_kv_heads, head_dim)[slots], k_scale, q.dtype)
    values = _readable(v_cache.reshape(-1, num_kv_heads, head_dim)[slots], v_scale, q.dtype)

    query_pos = (lens - query_lens.to(device))[:, None] + torch.arange(max_q, device=device)[None, :]
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
    attended = torch.nn.functional.scaled_dot_product_attention(
        padded_q,
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    result[tokens] = attended[row, :, index_in_seq].to(result.dtype)


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = padded token, skipped
    k_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit k_cache's scale (None: 1.0)
    v_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit v_cache's scale (None: 1.0)
) -> None:
    """Scatter this step's keys and values into their cache slots; an 8-bit cache gets them quantized."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for cache, new, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        rows = new[keep]
        if cache.dtype in FP8_DTYPES:
            rows = quantize_kv_ref(rows, 1.0 if scale is None else scale, cache.dtype)
        cache.view(-1, *cache.shape[2:])[slots] = rows.to(cache.dtype)


def copy_blocks_ref(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
    block_mapping: torch.Tensor,  # int64 [num_pairs, 2]: (source block, destination block)
) -> None:
    """Copy-on-write: duplicate whole blocks in every layer's K and V cache."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
