"""Plain-torch paged-attention references: the CPU path and the kernels' oracle.

Each function has exactly the signature of its Triton-lang twin in this package.
"""
from __future__ import annotations

import torch


def unified_attention_ref(
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

    Vectorised over sequences: every context is gathered into one padded batch
    and handed to torch's fused ``scaled_dot_product_attention`` (GQA without
    repeating K/V), so a step costs a handful of torch ops, not one per sequence.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    device = q.device
    starts = query_start_loc.to(device=device, dtype=torch.long)
    lens = seq_lens.to(device=device, dtype=torch.long)
    query_lens = starts[1:] - starts[:-1]
    num_seqs = lens.numel()
    max_q = int(query_lens.max())
    max_s = int(lens.max())

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
    index_in_seq = torch.arange(num_tokens, device=device) - starts[seq_of_token]
    padded_q = q.new_zeros(num_seqs, num_heads, max_q, head_dim)
    padded_q[seq_of_token, :, index_in_seq] = q

    key_pos = torch.arange(max_s, device=device)
    blocks = block_table.to(device=device, dtype=torch.long)[:, key_pos // block_size]
    slots = blocks * block_size + key_pos % block_size  # [num_seqs, max_s]
    # Slots past a sequence's end are masked out below; they must hold finite values
    # (the runner zero-fills the cache, and only finite K/V are ever written).
    in_range = key_pos[None, :] < lens[:, None]
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots]
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots]

    query_pos = (lens - query_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_range[:, None, :]
    attended = torch.nn.functional.scaled_dot_product_attention(
        padded_q,
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    result = attended[seq_of_token, :, index_in_seq]
    if out is None:
        return result
    out.copy_(result)
    return out


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = padded token, skipped
) -> None:
    """Scatter this step's keys and values into their cache slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


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
