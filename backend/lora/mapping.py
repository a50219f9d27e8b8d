"""A step's LoRA grouping, built once on the host with the step's inputs and read by every adapted linear.

Tokens are grouped by adapter slot (a stable sort, so a sequence's tokens keep their order): the GPU kernels read
the groups as segments (:mod:`pagedllm.kernels.lora_sgmv`), the CPU path as one row selection per adapter. Base
model tokens belong to no group and are never touched. A step with no adapter token has no mapping at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.lora.slots import BASE_SLOT


@dataclass(frozen=True, slots=True)
class LoRAGroup:
    """One adapter's tokens in a step: a slice when they are contiguous in the batch, else their indices."""

    slot: int
    rows: slice | torch.Tensor


@dataclass(frozen=True, slots=True)
class LoRAMapping:
    token_indices: torch.Tensor  # int32 [num_lora_tokens]: flat token indices, grouped by slot
    seg_starts: torch.Tensor  # int32 [num_segments + 1]: each group's offset into token_indices
    seg_slots: torch.Tensor  # int32 [num_segments]
    max_seg_len: int
    groups: tuple[LoRAGroup, ...]  # the same groups on the host, for the CPU path
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
    groups = []
    for slot, start, stop in zip(seg_slots.tolist(), seg_starts[:-1].tolist(), seg_starts[1:].tolist()):
        indices = token_indices[start:stop]
        contiguous = int(indices[-1]) - int(indices[0]) == stop - start - 1
        rows = slice(int(indices[0]), int(indices[-1]) + 1) if contiguous else torch.from_numpy(indices.astype(np.int64))
        groups.append(LoRAGroup(slot, rows))
    return LoRAMapping(
        token_indices=torch.from_numpy(token_indices).to(device),
        seg_starts=torch.from_numpy(seg_starts).to(device),
        seg_slots=torch.from_numpy(seg_slots).to(device),
        max_seg_len=int(np.diff(seg_starts).max()),
        groups=tuple(groups),
        seq_slots=seq_slots,
    )
