"""Runs one scheduled step through the model: flat batch in, last-token logits out."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.worker.attention_backend import AttentionBackend
from pagedllm.worker.cuda_graphs import DecodeGraphs
from pagedllm.worker.input_batch import InputBatch, StepInputs
from pagedllm.models import CausalLM
from pagedllm.core.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The most a step can hold, which sizes the persistent input batch."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class ModelRunner:
    """Owns the model and the per-layer K/V cache tensors; replays decode steps as CUDA graphs when asked."""

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        limits: BatchLimits,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = device
        max_blocks_per_seq = -(-limits.max_model_len // block_size)
        # Graphs replay fixed shapes, so decode batches are padded up to the captured sizes.
        self.input_batch = InputBatch(limits.max_num_seqs, limits.max_num_batched_tokens, max_blocks_per_seq,
                                      block_size, device, pad_decodes=cuda_graphs)
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [(attention.new_cache(shape, dtype, device), attention.new_cache(shape, dtype, device))
                          for _ in range(model.num_layers)]
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(model, attention, self.kv_caches, self.input_batch.buckets,
                                           max_blocks_per_seq, device)

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
        if self.graphs is not None and (logits := self.graphs.replay(inputs)) is not None:
            return logits
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.attention.plan(inputs.attn))
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled chunks into one token batch and its attention layout."""
        return self.input_batch.prepare(step)
