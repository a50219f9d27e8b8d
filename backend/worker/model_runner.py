"""Runs one scheduled step through the model: flat batch in, last-token logits out."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.core.config import EngineConfig
from pagedllm.core.kv_sizing import CPU_KV_BUDGET_BYTES, kv_block_bytes
from pagedllm.lora.manager import LoRAManager
from pagedllm.attention.backends import AttentionBackend
from pagedllm.worker.cuda_graphs import DecodeGraphs
from pagedllm.worker.input_batch import InputBatch, StepInputs
from pagedllm.models import CausalLM
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.worker.step_wire import broadcast_step


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The most a step can hold, which sizes the persistent input batch."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class ModelRunner:
    """Owns the model and the per-layer K/V cache tensors; replays decode steps as CUDA graphs when asked.

    Under tensor parallelism every rank has one, over its share of the model and of the KV heads; rank 0's
    ``execute`` prepares the step and broadcasts it, the other ranks ``run`` what they receive.
    """

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
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.attention = attention
        self.block_size = block_size
        self.device = device
        max_blocks_per_seq = -(-limits.max_model_len // block_size)
        # Graphs replay fixed shapes, so decode batches are padded up to the captured sizes.
        self.input_batch = InputBatch(limits.max_num_seqs, limits.max_num_batched_tokens, max_blocks_per_seq,
                                      block_size, device, pad_decodes=cuda_graphs,
                                      lora_slot_of=None if lora is None else lora.slot_of)
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [(attention.new_cache(shape, dtype, device), attention.new_cache(shape, dtype, device))
                          for _ in range(model.num_layers)]
        self.graphs: DecodeGraphs | None = None
        # The last step's hidden state of every position (None after a graph replay): prompt logprobs read the
        # prompt's positions from it (pagedllm.engine.prompt_logprobs).
        self.last_hidden: torch.Tensor | None = None
        if cuda_graphs:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(model, attention, self.kv_caches, self.input_batch.buckets,
                                           max_blocks_per_seq, device)

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
        """``dtype``: the cache's (an 8-bit KV cache holds twice the blocks of a bf16 one)."""
        element = torch.empty((), dtype=dtype).element_size()
        return kv_block_bytes(model.num_layers, model.num_kv_heads, model.head_dim, block_size, element)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Forward the step's tokens; returns float32 logits [num_sampled, vocab]."""
        lora_loads = self.lora.apply_loads() if self.lora is not None else []
        inputs = self.prepare(step)
        if self.model.tp.size > 1:
            broadcast_step(inputs, list(step.block_copies), self.model.tp, lora_loads)
        logits = self.run(inputs, step.block_copies)
        if logits is None:
            raise RuntimeError("rank 0 received no logits from the tensor-parallel gather")
        return logits

    @torch.inference_mode()
    def run(self, inputs: StepInputs, block_copies: Sequence[tuple[int, int]]) -> torch.Tensor | None:
        """Copy-on-write copies, then the forward; logits on rank 0, ``None`` on the other ranks."""
        if block_copies:
            mapping = torch.tensor(block_copies, dtype=torch.int64, device=self.device)
            self.attention.copy_blocks(self.kv_caches, mapping)
        self.last_hidden = None
        if self.graphs is not None and (logits := self.graphs.replay(inputs)) is not None:
            return logits
        if self.lora is not None:
            self.lora.context.mapping = inputs.lora
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.attention.plan(inputs.attn))
        self.last_hidden = hidden
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled chunks into one token batch and its attention layout."""
        return self.input_batch.prepare(step)


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes this rank may fill with KV blocks: ``kv_cache_memory_gb``, else on CUDA
    ``gpu_memory_utilization`` of the device less what is already used, else 1 GiB on a CPU."""
    if config.kv_cache_memory_gb is not None:
        return int(config.kv_cache_memory_gb * (1 << 30))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - (1 - config.gpu_memory_utilization) * total)
    return CPU_KV_BUDGET_BYTES
