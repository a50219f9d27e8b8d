"""The one description of a step's batch layout that every attention call reads."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Layout of a flat token batch mixing prefill chunks and decodes.

    Sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]`` of the
    flat batch; they are the last ``query_len`` positions of its ``seq_lens[i]``
    context tokens (causal). Built once per step by the model runner, then handed
    to ``AttentionBackend.plan``, which returns a copy carrying ``plan``: the
    backend's per-step work (index math, masks, launch tiles), shared by every layer.
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], context length including the new tokens
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens], cache slot = block * block_size + offset
    max_query_len: int
    max_seq_len: int
    plan: object | None = None  # the planning backend's own type; None until planned

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()
