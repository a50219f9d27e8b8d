"""The sparse mixture-of-experts block of the Llama-family layer (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router picks each token's top-k experts (:mod:`pagedllm.layers.moe_traits`
for the rule); the experts' weights are stacked per layer, gate|up as
``[E, 2 * I, H]`` and down as ``[E, H, I]``, so one kernel call serves every
expert. On CUDA that is the Triton-lang fused kernel
(:func:`pagedllm.kernels.fused_moe.fused_moe`); on the CPU in float32 a compiled
C routine that runs every expert of a step in one call, on weights it packs once
(:mod:`pagedllm.layers.moe_cpu`); on the CPU in bf16 its bf16 twin, on AMX tiles or avx512_bf16
(:mod:`pagedllm.layers.moe_bf16`), or where that cannot run each expert's GEMMs on oneDNN-packed weights
(:mod:`pagedllm.layers.moe_onednn`); elsewhere the kernel's plain-torch twin, which
groups the tokens by expert with one sort and runs each chosen expert's GEMMs on
its own tokens. Qwen2-MoE adds a shared expert that every token runs, scaled by a
sigmoid gate.

Under tensor parallelism each rank holds a slice of every expert, split like
the dense MLP (gate|up rows and down columns of the intermediate dimension,
:mod:`pagedllm.distributed.sharding`'s rule); the router is replicated, so every
rank routes alike. The experts' and the shared expert's partial sums are added
and reduced with one all-reduce.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from pagedllm.kernels.fused_moe_reference import fused_moe_ref
from pagedllm.layers.moe_bf16 import Bf16Experts, load_native_moe_bf16
from pagedllm.layers.moe_cpu import PackedExperts, load_native_moe, pack_experts
from pagedllm.layers.moe_onednn import OneDnnExperts
from pagedllm.layers.moe_traits import MoeTraits
from pagedllm.layers.tensor_parallel import ParameterSource, TensorPart
from pagedllm.distributed.group import TensorParallel
from pagedllm.distributed.sharding import ShardLayout, shard_layout

# (hidden, w_gate_up, w_down, topk_weights, topk_ids) -> hidden: the fused kernel or its torch twin.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SparseMoeBlock(nn.Module):
    """Router, stacked experts and the optional shared expert; replaces the dense MLP of a sparse layer.

    ``shared_expert``: the model's MLP built on :func:`intermediate_layout` for
    ``shared_expert_intermediate_size`` without its own all-reduce (this block
    reduces once for both), or ``None`` when the architecture has none.
    """

    def __init__(self, hidden_size: int, traits: MoeTraits, layout: ShardLayout, tp: TensorParallel,
                 shared_expert: nn.Module | None) -> None:
        super().__init__()
        if (shared_expert is None) != (traits.shared_expert_intermediate_size == 0):
            raise ValueError("shared_expert must be given exactly when shared_expert_intermediate_size > 0")
        self.traits = traits
        self.tp = tp
        self.expert_layout = intermediate_layout(layout, traits.expert_intermediate_size, "moe_intermediate_size")
        self.shared_layout = (intermediate_layout(layout, traits.shared_expert_intermediate_size,
                                                  "shared_expert_intermediate_size") if shared_expert else None)
        inter = self.expert_layout.intermediate_size
        self.gate = nn.Linear(hidden_size, traits.num_experts, bias=False)  # the router
        self.w_gate_up = nn.Parameter(torch.empty(traits.num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(traits.num_experts, hidden_size, inter), requires_grad=False)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None
        self._packed: PackedExperts | None = None  # the experts packed for the compiled CPU routine, on first use
        self._bf16: Bf16Experts | None = None  # the bf16 experts packed for the compiled routine, on first use
        self._onednn: OneDnnExperts | None = None  # the bf16 experts packed for oneDNN where that cannot run
        self.requires_grad_(False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, expert ids int64 [T, k])``: transformers' router, op for op."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.traits.top_k, dim=-1)
        if self.traits.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self._cpu_experts(x, weights, ids) if x.device.type == "cpu" else None
        if out is None:
            out = _experts(x.device)(x, self.w_gate_up, self.w_down, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The gate is replicated, so scaling each rank's partial sum before the reduce is exact.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def _cpu_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """The routed experts on weights packed once (on first use: the weights do not change after loading), by
        a compiled routine (float32, or bf16 where the CPU has avx512_bf16) or else oneDNN in bf16; ``None`` where
        none applies to ``x``."""
        native = load_native_moe()
        if native is not None and native.applies(x, self.w_gate_up):
            if self._packed is None:
                self._packed = pack_experts(self.w_gate_up, self.w_down)
                self._empty_expert_parameters()
            return native.run(x, self._packed, weights, ids)
        if self._bf16 is None and self._onednn is None and Bf16Experts.applies(x, self.w_gate_up):
            routine = load_native_moe_bf16()
            if routine is not None:
                self._bf16 = Bf16Experts(routine, self.w_gate_up, self.w_down)
            elif OneDnnExperts.applies(x, self.w_gate_up):
                self._onednn = OneDnnExperts(self.w_gate_up, self.w_down)
            if self._bf16 is not None or self._onednn is not None:
                self._empty_expert_parameters()
        if self._bf16 is not None:
            return self._bf16(x, weights, ids)
        if self._onednn is not None:
            return self._onednn(x, weights, ids)
        return None

    def _empty_expert_parameters(self) -> None:
        """The packed experts replace the parameters' data: kept beside them, a second copy of every expert would
        double a large MoE model's memory at its first request."""
        for parameter in (self.w_gate_up, self.w_down):
            parameter.data = parameter.data.new_empty(0)

    def checkpoint_sources(self, prefix: str, checkpoint_prefix: str) -> dict[str, ParameterSource]:
        """Where each of this block's parameters comes from (this rank's rows of it).

        ``prefix``: the block's parameter prefix (``model.layers.3.mlp.``); ``checkpoint_prefix``: its prefix in
        the checkpoint (``model.layers.3.block_sparse_moe.`` for Mixtral). The stacked experts concatenate each
        expert's gate and up rows (then its down columns) expert by expert, stacked into ``[E, rows, cols]``.
        """
        gate, up, down = self.traits.expert_tensor_names
        experts = [f"{checkpoint_prefix}experts.{e}." for e in range(self.traits.num_experts)]
        rows, columns = self.expert_layout.mlp_rows(), self.expert_layout.down_columns()
        stack = self.traits.num_experts
        sources = {
            f"{prefix}gate.weight": ParameterSource((TensorPart(f"{checkpoint_prefix}gate.weight"),)),
            f"{prefix}w_gate_up": ParameterSource(tuple(TensorPart(f"{expert}{name}.weight", rows)
                                                        for expert in experts for name in (gate, up)), stack),
            f"{prefix}w_down": ParameterSource(tuple(TensorPart(f"{expert}{down}.weight", columns)
                                                     for expert in experts), stack),
        }
        if self.shared_layout is not None:
            shared, in_checkpoint = f"{prefix}shared_expert.", f"{checkpoint_prefix}shared_expert."
            shared_rows = self.shared_layout.mlp_rows()
            sources[f"{shared}gate_up_proj.weight"] = ParameterSource(tuple(
                TensorPart(f"{in_checkpoint}{name}_proj.weight", shared_rows) for name in ("gate", "up")))
            sources[f"{shared}down_proj.weight"] = ParameterSource(
                (TensorPart(f"{in_checkpoint}down_proj.weight", self.shared_layout.down_columns()),))
            sources[f"{prefix}shared_expert_gate.weight"] = ParameterSource(
                (TensorPart(f"{checkpoint_prefix}shared_expert_gate.weight"),))
        return sources


def intermediate_layout(layout: ShardLayout, intermediate_size: int, key: str) -> ShardLayout:
    """``layout`` for a gated MLP of another intermediate size (an expert, the shared expert): the same
    sharding rule splits its rows. ``ValueError`` naming the config ``key`` when the group cannot split it."""
    if intermediate_size % layout.size:
        raise ValueError(f"tensor_parallel_size={layout.size} does not divide the model's {key}={intermediate_size}")
    shape = replace(layout.shape, intermediate_size=intermediate_size)
    return shard_layout(shape, layout.rank, layout.size)


def _experts(device: torch.device) -> ExpertsFn:
    """The fused kernel on CUDA (imported there only: triton is optional on CPU), the grouped torch path elsewhere
    (the CPU's float32 steps run the compiled routine instead, in :meth:`SparseMoeBlock.forward`)."""
    if device.type == "cuda":
        from pagedllm.kernels.fused_moe import fused_moe

        return fused_moe
    return fused_moe_ref
