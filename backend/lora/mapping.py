"""A step's LoRA grouping, built once on the host with the step's inputs and read by every adapted linear.

Tokens are grouped by adapter slot (a stable sort, so a sequence's tokens keep their order): the GPU kernels read
the groups as segments (:mod:`pagedllm.kernels.lora_sgmv`); the CPU path gathers the step's adapter tokens once in
that order (``rows``) and multiplies each adapter's span of them. Base model tokens belong to no group and are never
touched. A step with no adapter token has no mapping at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.lora.slots import BASE_SLOT


@dataclass(frozen=True, slots=True)
class LoRASpan:
    """One adapter's tokens: ``[start, stop)`` of the step's adapter tokens in slot order."""

    slot: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class LoRAMapping:
    token_indices: torch.Tensor  # int32 [num_lora_tokens]: flat token indices, grouped by slot
    seg_starts: torch.Tensor  # int32 [num_segments + 1]: each group's offset into token_indices
    seg_slots: torch.Tensor  # int32 [num_segments]
    max_seg_len: int
    # The same groups on the host, for the CPU path: the adapter tokens in slot order, as a slice when that is the
    # batch's own order over one range (no gather), else int64 indices; and each adapter's span of them.
    rows: slice | torch.Tensor
    spans: tuple[LoRASpan, ...]
    seq_slots: np.ndarray  # int64 [num_seqs]: each sequence's slot, what other tensor-parallel ranks rebuild it from


def build_lora_mapping(seq_slots: np.ndarray, query_lens: np.ndarray, device: torch.device) -> LoRAMapping | None:
    """The grouping of a step whose i-th sequence runs ``query_lens[i]`` tokens through slot ``seq_slots[i]``."""
    if not (seq_slots != BASE_SLOT).any():
        return None
    token_slots = np.repeat(seq_slots, query_lens)
    order = np.argsort(token_slots, kind="stable")
    order = order[token_slots[order] != BASE_SLOT]
    sorted_slots = token_slots[order]
    boundaries = np.flatnonzero(np.diff(sorted_slots)) + 1
    seg_starts = np.concatenate(([0], boundaries, [len(order)])).astype(np.int32)
    seg_slots = sorted_slots[seg_starts[:-1]].astype(np.int32)
    token_indices = order.astype(np.int32)
    spans = tuple(LoRASpan(slot, start, stop)
                  for slot, start, stop in zip(seg_slots.tolist(), seg_starts[:-1].tolist(), seg_starts[1:].tolist()))
    first, last = int(order[0]), int(order[-1])
    in_place = last - first == len(order) - 1 and bool((np.diff(order) == 1).all())
    rows = slice(first, last + 1) if in_place else torch.from_numpy(order.astype(np.int64))
    return LoRAMapping(
        token_indices=torch.from_numpy(token_indices).to(device),
        seg_starts=torch.from_numpy(seg_starts).to(device),
        seg_slots=torch.from_numpy(seg_slots).to(device),
        max_seg_len=int(np.diff(seg_starts).max()),
        rows=rows,
        spans=spans,
        seq_slots=seq_slots,
    )
