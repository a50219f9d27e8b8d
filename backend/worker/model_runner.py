"""Runs one scheduled step through the model: flat batch in, last-token logits out."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.worker.attention_backend import AttentionBackend
from pagedllm.worker.attention_metadata import AttentionMetadata
from pagedllm.models import CausalLM
from pagedllm.core.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Host-built tensors of one step, moved to the device in one go."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]: the flat index of each sampled sequence's last token


class ModelRunner:
    """Owns the model and the per-layer K/V cache tensors."""

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Forward the step's tokens; returns float32 logits [num_sampled, vocab]."""
        if step.block_copies:
            mapping = torch.tensor(step.block_copies, dtype=torch.int64, device=self.device)
            self.attention.copy_blocks(self.kv_caches, mapping)
        inputs = self.prepare(step)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.attention.plan(inputs.attn))
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled chunks into one token batch and its attention layout."""
        bs = self.block_size
        query_lens = np.fromiter((s.num_tokens for s in step.scheduled), dtype=np.int64)
        starts = np.fromiter((s.seq.num_computed_tokens for s in step.scheduled), dtype=np.int64)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        # Position of every flat token inside its own sequence.
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        positions = np.arange(num_tokens) - query_start_loc[seq_of_token] + starts[seq_of_token]

        max_blocks = max(len(s.seq.block_ids) for s in step.scheduled)
        block_table = np.zeros((len(query_lens), max_blocks), dtype=np.int64)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        for i, item in enumerate(step.scheduled):
            seq = item.seq
            block_table[i, : len(seq.block_ids)] = seq.block_ids
            lo, hi = query_start_loc[i], query_start_loc[i + 1]
            input_ids[lo:hi] = seq.token_ids[starts[i] : seq_lens[i]]
        slot_mapping = block_table[seq_of_token, positions // bs] * bs + positions % bs

        sampled = [i for i, item in enumerate(step.scheduled) if item.completes_prefill]
        logits_indices = query_start_loc[1:][sampled] - 1

        def put(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(array).to(device=self.device, dtype=dtype, non_blocking=True)

        attn = AttentionMetadata(
            query_start_loc=put(query_start_loc, torch.int32),
            seq_lens=put(seq_lens, torch.int32),
            block_table=put(block_table, torch.int32),
            slot_mapping=put(slot_mapping, torch.int64),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return StepInputs(put(input_ids, torch.int64), put(positions, torch.int64), attn, put(logits_indices, torch.int64))
