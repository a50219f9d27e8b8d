"""The sparse mixture-of-experts block of the Llama-family layer (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router picks each token's top-k experts (:mod:`pagedllm.models.moe_traits`
for the rule); the experts' weights are stacked per layer, gate|up as
``[E, 2 * I, H]`` and down as ``[E, H, I]``, so one kernel call serves every
expert. On CUDA that is the Triton-lang fused kernel
(:func:`pagedllm.kernels.fused_moe.fused_moe`); elsewhere its plain-torch twin,
which groups the tokens by expert with one sort and runs each chosen expert's
GEMMs on its own tokens. Qwen2-MoE adds a shared expert that every token runs,
scaled by a sigmoid gate.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.kernels.fused_moe_reference import fused_moe_ref
from pagedllm.models.moe_traits import MoeTraits

# (hidden, w_gate_up, w_down, topk_weights, topk_ids) -> hidden: the fused kernel or its torch twin.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SparseMoeBlock(nn.Module):
    """Router, stacked experts and the optional shared expert; replaces the dense MLP of a sparse layer.

    ``shared_expert``: a dense MLP of ``shared_expert_intermediate_size`` (built by the caller, so the
    shared expert is exactly the model's MLP), or ``None``.
    """

    def __init__(self, hidden_size: int, traits: MoeTraits, shared_expert: nn.Module | None) -> None:
        super().__init__()
        if (shared_expert is None) != (traits.shared_expert_intermediate_size == 0):
            raise ValueError("shared_expert must be given exactly when shared_expert_intermediate_size > 0")
        self.traits = traits
        self.gate = nn.Linear(hidden_size, traits.num_experts, bias=False)  # the router
        inter = traits.expert_intermediate_size
        self.w_gate_up = nn.Parameter(torch.empty(traits.num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(traits.num_experts, hidden_size, inter), requires_grad=False)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None
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
        out = _experts(x.device)(x, self.w_gate_up, self.w_down, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def checkpoint_sources(self, prefix: str, checkpoint_prefix: str) -> dict[str, list[str]]:
        """The stacked experts' checkpoint tensors, concatenated along dim 0 in order (``[E * rows, cols]``,
        which is the stack viewed flat): expert by expert, gate then up rows; down.

        ``prefix``: this block's parameter prefix (``model.layers.3.mlp.``); ``checkpoint_prefix``: the
        block's prefix in the checkpoint (``model.layers.3.block_sparse_moe.`` for Mixtral).
        """
        gate, up, down = self.traits.expert_tensor_names
        experts = [f"{checkpoint_prefix}experts.{e}." for e in range(self.traits.num_experts)]
        return {
            f"{prefix}w_gate_up": [f"{expert}{name}.weight" for expert in experts for name in (gate, up)],
            f"{prefix}w_down": [f"{expert}{down}.weight" for expert in experts],
        }


def _experts(device: torch.device) -> ExpertsFn:
    """The fused kernel on CUDA (imported there only: triton is optional on CPU), the grouped torch path elsewhere."""
    if device.type == "cuda":
        from pagedllm.kernels.fused_moe import fused_moe

        return fused_moe
    return fused_moe_ref
