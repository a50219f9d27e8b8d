"""Decode steps replayed as CUDA graphs: one graph per padded batch size.

A decode step of a large model is hundreds of small kernel launches, and on a
fast GPU launching them from Python takes about as long as running them. A
CUDA graph records the launches once and replays them with a single call.

A graph replays fixed addresses and fixed launch shapes, so each captured size
owns static input tensors (token ids, positions, the attention layout) that a
step copies its inputs into before replaying. The block table is captured at
its full width, which is what makes the attention launch shape-stable: the
Triton kernel's tiles and split-KV plan depend only on tensor shapes
(``pagedllm.kernels.attention_heuristics``), never on the lengths inside.
Padding rows write no KV (slot -1) and their logits are dropped.

Prefill and mixed steps, and decode batches above the largest captured size,
run eagerly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.models import CausalLM
from pagedllm.attention.backends import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.input_batch import StepInputs

# vLLM's default too: above this a decode step is long enough that launch time is a small share of it.
MAX_CAPTURED_BATCH = 512


@dataclass(frozen=True, slots=True)
class _CapturedStep:
    """One graph and the tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # int64 [size]
    positions: torch.Tensor  # int64 [size]
    attn: AttentionMetadata  # static layout tensors at full block-table width
    logits: torch.Tensor  # float32 [size, vocab], written by each replay


class DecodeGraphs:
    """Captures the model's decode step at each of ``sizes`` and replays the one a step fits."""

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device; the engine runs on {device}")
        if attention.name != "triton":
            raise ValueError(f"cuda_graphs needs the triton attention backend, not {attention.name!r}: "
                             "the other backends plan each step on the host from the sequence lengths")
        self._model = model
        self._attention = attention
        self._kv_caches = kv_caches
        self._max_blocks_per_seq = max_blocks_per_seq
        self._device = device
        self._steps: dict[int, _CapturedStep] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # Largest first, so the smaller graphs reuse the memory the largest one's pool already holds.
        for size in sorted((s for s in sizes if s <= MAX_CAPTURED_BATCH), reverse=True):
            self._steps[size] = self._capture(size)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._steps))

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's logits [decode_rows, vocab] from a graph, or ``None`` when no graph fits it."""
        if inputs.decode_rows is None:
            return None
        size = inputs.input_ids.numel()
        captured = self._steps.get(size)
        if captured is None:
            return None
        self._model.require_context_fits(inputs.attn.max_seq_len)
        width = inputs.attn.block_table.shape[1]
        captured.input_ids.copy_(inputs.input_ids)
        captured.positions.copy_(inputs.positions)
        static = captured.attn
        static.query_start_loc.copy_(inputs.attn.query_start_loc)
        static.seq_lens.copy_(inputs.attn.seq_lens)
        static.slot_mapping.copy_(inputs.attn.slot_mapping)
        # Columns past this step's width keep older block ids; the kernel reads no block past seq_lens.
        static.block_table[:, :width].copy_(inputs.attn.block_table)
        captured.graph.replay()
        return captured.logits[: inputs.decode_rows]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        hidden = self._model(input_ids, positions, self._kv_caches, self._attention.plan(attn))
        return self._model.compute_logits(hidden)

    def _capture(self, size: int) -> _CapturedStep:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self._device)

        input_ids = zeros(size, dtype=torch.int64)
        positions = zeros(size, dtype=torch.int64)
        # A harmless layout to record with: every row one token of context, writing no KV.
        attn = AttentionMetadata(
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=self._device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=self._device),
            block_table=zeros(size, self._max_blocks_per_seq, dtype=torch.int32),
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=self._device),
            max_query_len=1,
            max_seq_len=1,
        )
        # Compile the Triton kernels and let the allocator settle outside the capture.
        self._forward(input_ids, positions, attn)
        torch.cuda.synchronize(self._device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(input_ids, positions, attn)
        return _CapturedStep(graph, input_ids, positions, attn, logits)
