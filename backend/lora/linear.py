"""A linear with batched LoRA around it: ``y = base(x)``, then ``y[t] += (x[t] A_s^T) B_s^T`` for each token ``t`` of
slot ``s``'s group in the step's :class:`~pagedllm.lora.mapping.LoRAMapping`.

The base module is left as it is (an ``nn.Linear`` or a packed CPU linear). Each slot's ``A`` and scaled ``B`` sit in
one buffer per linear; a fused linear (q|k|v, gate|up) stacks its parts' ranks along the rank axis and places each
part's ``B`` block-diagonally at its output rows, so one shrink and one expand serve all parts. Parts are packed at
the adapter's own rank, so the CPU path multiplies only a slot's used width; the padding is zeros. On CUDA the
Triton-lang kernels run the segments; elsewhere one pair of torch matmuls per adapter group does.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pagedllm.lora.mapping import LoRAMapping


class LoRAContext:
    """The step's grouping: set by the runner before each forward, read by every adapted linear of the model."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, part_sizes: Sequence[int], max_loras: int, max_rank: int,
                 context: LoRAContext, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.in_features: int = base.in_features
        self.out_features: int = base.out_features
        if sum(part_sizes) != self.out_features:
            raise ValueError(f"parts {list(part_sizes)} do not add up to the linear's {self.out_features} outputs")
        self.part_sizes = tuple(part_sizes)
        self.max_rank = max_rank
        self.context = context
        width = max_rank * len(part_sizes)
        self.lora_a = torch.zeros(max_loras, width, self.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, self.out_features, width, dtype=dtype, device=device)
        self.use_kernels = device.type == "cuda"
        self.slot_width = [0] * max_loras  # rank columns a slot's adapter uses (parts x its rank)

    def set_slot(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None], scale: float) -> None:
        """Hold an adapter in ``slot``: per part ``(A [r, in], B [out_part, r])``, or ``None`` where it adapts none."""
        if len(parts) != len(self.part_sizes):
            raise ValueError(f"{len(parts)} parts for a linear of {len(self.part_sizes)}")
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        row = width = 0
        for index, (part, size) in enumerate(zip(parts, self.part_sizes)):
            if part is not None:
                part_a, part_b = part
                rank = part_a.shape[0]
                column = index * rank
                a[column : column + rank] = part_a.to(a.dtype)
                b[row : row + size, column : column + rank] = (part_b.float() * scale).to(b.dtype)
                width = column + rank
            row += size
        self.slot_width[slot] = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mapping = self.context.mapping
        if mapping is None:
            return y
        if self.use_kernels:
            lora_shrink, lora_expand = _kernels()
            buffer = torch.empty(x.shape[0], self.lora_a.shape[1], dtype=torch.float32, device=x.device)
            segments = (mapping.token_indices, mapping.seg_starts, mapping.seg_slots, mapping.max_seg_len)
            lora_shrink(x, self.lora_a, buffer, *segments)
            lora_expand(buffer, self.lora_b, y, *segments)
            return y
        # One gather of the adapter tokens in slot order, two matmuls per adapter into one buffer, one scatter-add:
        # the op count per linear grows by two per adapter, not five.
        rows = x[mapping.rows]
        delta = torch.empty(rows.shape[0], self.out_features, dtype=y.dtype)
        for span in mapping.spans:
            width = self.slot_width[span.slot]
            if width == 0:  # the adapter leaves this linear alone
                delta[span.start : span.stop] = 0.0
                continue
            shrunk = torch.mm(rows[span.start : span.stop], self.lora_a[span.slot, :width].T)
            torch.mm(shrunk, self.lora_b[span.slot, :, :width].T, out=delta[span.start : span.stop])
        if isinstance(mapping.rows, slice):
            y[mapping.rows] += delta
        else:
            y.index_add_(0, mapping.rows, delta)
        return y


@functools.cache
def _kernels() -> tuple[Callable[..., None], Callable[..., None]]:
    """The Triton-lang shrink and expand, imported on first use: CPU-only engines never import triton for LoRA."""
    from pagedllm.kernels.lora_sgmv import lora_expand, lora_shrink

    return lora_shrink, lora_expand
