"""Group a step's routed (token, slot) pairs by expert, padded per expert to the fused-MoE kernel's row block.

The fused kernel multiplies one ``BLOCK_M``-row tile by one expert's weights per
program, so every tile must hold rows of a single expert: each expert's rows are
padded up to a multiple of ``BLOCK_M`` with a sentinel that the kernel masks out.
Everything here is a handful of tensor ops (one stable sort) with no host
synchronisation, so it runs on the kernel's device between the router and the
kernel, and inside a captured CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertAlignment:
    """Routed rows sorted by expert and padded per expert to ``block_m`` rows.

    A *routed row* is ``token * top_k + slot``: the token's ``slot``-th expert choice.
    """

    sorted_rows: torch.Tensor  # int32 [max_padded]: routed rows grouped by expert; ``num_rows`` marks padding
    block_experts: torch.Tensor  # int32 [max_padded // block_m]: the expert of each row block
    num_padded: torch.Tensor  # int32 [1]: rows in use (the rest are the spare tail of ``sorted_rows``)
    num_rows: int  # num_tokens * top_k, also the padding sentinel
    block_m: int

    @property
    def max_blocks(self) -> int:
        """Row blocks to launch: enough for the worst case, the unused ones exit at once."""
        return self.sorted_rows.numel() // self.block_m


def align_tokens_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort ``topk_ids`` [num_tokens, top_k] by expert (one stable sort) and pad each expert to ``block_m`` rows.

    Experts no token chose get no block. The worst case (every expert holding
    ``block_m - 1`` rows of padding) sizes the output, so nothing waits on the
    device to learn the real total.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [num_tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be positive, got {num_experts} and {block_m}")
    device = topk_ids.device
    experts = topk_ids.reshape(-1).long()
    num_rows = experts.numel()
    order = torch.argsort(experts, stable=True)
    # A scatter-add rather than bincount, whose output size depends on the ids' maximum (a device sync).
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, experts,
                                                                                   torch.ones_like(experts))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    starts = torch.cumsum(counts, 0) - counts
    # The i-th row of the sorted order goes to its expert's padded start plus its rank inside the expert.
    sorted_experts = experts[order]
    rank = torch.arange(num_rows, device=device) - starts[sorted_experts]
    destination = (padded_ends - padded_counts)[sorted_experts] + rank

    max_padded = _round_up(num_rows + num_experts * (block_m - 1), block_m)
    sorted_rows = torch.full((max_padded,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[destination] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    # Blocks past the last expert's end are never run; clamping keeps their expert id a valid index anyway.
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertAlignment(
        sorted_rows=sorted_rows,
        block_experts=block_experts.to(torch.int32),
        num_padded=padded_ends[-1:].to(torch.int32),
        num_rows=num_rows,
        block_m=block_m,
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
