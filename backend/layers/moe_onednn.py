"""bf16 CPU experts of the MoE block on oneDNN-packed weights: each expert's two GEMMs on weights packed once.

The compiled routine (:mod:`pagedllm.layers.moe_cpu`) takes float32 only, so bf16 MoE blocks ran the plain-torch
reference (:func:`pagedllm.kernels.fused_moe_reference.fused_moe_ref`), whose bf16 ``F.linear`` and ``torch.mm``
re-lay out an expert's weight on every call, as unpacked dense linears do (:mod:`pagedllm.layers.cpu_linear`).
Here every expert's gate|up and down weights are packed once for oneDNN, as the dense layers' are, and the
reference's grouping, activation and weighted sum run around them unchanged: the same bits as the reference
(``tests/test_moe_cpu.py``), since a packed bf16 product equals ``F.linear``'s. The block then empties its
expert parameters (:meth:`pagedllm.layers.moe.SparseMoeBlock.forward`), so the packed weights are the only copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels.fused_moe_reference import grouped_experts
from pagedllm.layers.cpu_linear import PackedLinear, packed_linear, packed_linear_choice


class OneDnnExperts:
    """A block's stacked bf16 experts, ``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]``, packed expert by expert."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        self._gate_up: list[PackedLinear] = [packed_linear(weight, None, "onednn") for weight in w_gate_up]
        self._down: list[PackedLinear] = [packed_linear(weight, None, "onednn") for weight in w_down]
        self._inter = w_gate_up.shape[1] // 2

    @staticmethod
    def applies(hidden: torch.Tensor, w_gate_up: torch.Tensor) -> bool:
        """Whether these inputs are this path's: bf16 on a CPU whose bf16 linears take the oneDNN packing."""
        return (hidden.device.type == "cpu" and hidden.dtype == w_gate_up.dtype == torch.bfloat16
                and packed_linear_choice(torch.bfloat16, hidden.device) == "onednn")

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for ``hidden [T, H]`` under the routing ``[T, top_k]``."""
        if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != hidden.shape[0]:
            raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} do not "
                             f"route hidden {tuple(hidden.shape)}")
        if topk_ids.numel() and not 0 <= int(topk_ids.min()) <= int(topk_ids.max()) < len(self._gate_up):
            raise ValueError(f"topk_ids holds expert ids outside [0, {len(self._gate_up)})")
        return grouped_experts(hidden, topk_weights, topk_ids, len(self._gate_up), self._expert)

    def _expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = self._gate_up[index].forward(rows)
        inter = self._inter
        return self._down[index].forward(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
