"""Plain-torch references of the batched LoRA kernels (:mod:`pagedllm.kernels.lora_sgmv`), same signatures.

A step's LoRA tokens are listed grouped by adapter slot: ``token_indices[seg_starts[g]:seg_starts[g + 1]]`` are
the flat token indices of segment ``g``, which runs through slot ``seg_slots[g]``. Tokens in no segment (base
model rows) are never read or written. The CPU engine runs the same grouping with its own matmuls
(:mod:`pagedllm.lora.linear`); these are the kernels' oracle.
"""
from __future__ import annotations

import torch


def lora_shrink_ref(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [num_slots, rank, in_features]
    out: torch.Tensor,  # float32 [num_tokens, rank]: rows of segment tokens are overwritten
    token_indices: torch.Tensor,  # int32 [num_lora_tokens]
    seg_starts: torch.Tensor,  # int32 [num_segments + 1]
    seg_slots: torch.Tensor,  # int32 [num_segments]
    max_seg_len: int,
) -> None:
    """``out[t] = x[t] @ lora_a[slot]^T`` for every token ``t`` of every segment, accumulated in float32."""
    starts = seg_starts.tolist()
    for segment, slot in enumerate(seg_slots.tolist()):
        rows = token_indices[starts[segment] : starts[segment + 1]].long()
        out[rows] = x[rows].float() @ lora_a[slot].float().T


def lora_expand_ref(
    buffer: torch.Tensor,  # float32 [num_tokens, rank]: the shrink's output
    lora_b: torch.Tensor,  # [num_slots, out_features, rank]
    y: torch.Tensor,  # [num_tokens, out_features]: added to in place
    token_indices: torch.Tensor,  # int32 [num_lora_tokens]
    seg_starts: torch.Tensor,  # int32 [num_segments + 1]
    seg_slots: torch.Tensor,  # int32 [num_segments]
    max_seg_len: int,
) -> None:
    """``y[t] += buffer[t] @ lora_b[slot]^T`` for every token ``t`` of every segment (float32 sum, cast once)."""
    starts = seg_starts.tolist()
    for segment, slot in enumerate(seg_slots.tolist()):
        rows = token_indices[starts[segment] : starts[segment + 1]].long()
        y[rows] = (y[rows].float() + buffer[rows] @ lora_b[slot].float().T).to(y.dtype)
