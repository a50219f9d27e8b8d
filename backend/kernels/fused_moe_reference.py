"""Plain-torch mixture-of-experts FFN: the CPU path of the MoE block and the fused kernel's oracle.

Same signature as :func:`pagedllm.kernels.fused_moe.fused_moe`. The step's
routed (token, choice) pairs are grouped by expert with one stable sort; each
expert that was chosen runs its two GEMMs on its own tokens only, and the
weighted results are scattered back with ``index_add_``. The Python loop runs
over the experts that received tokens, never over tokens.

The arithmetic follows transformers' expert loop (gate|up GEMM, ``silu(gate) *
up``, down GEMM, times the routing weight, added in ascending expert order),
so float32 results match it up to the GEMM library's own rounding.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.kernels.launch_support import FLOAT_DTYPES, INDEX_DTYPES, require_dtype, require_ndim, require_same_device

# (expert, its grouped input rows [n, hidden]) -> its output rows [n, hidden], before the routing weight.
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def fused_moe_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden_size]: gate rows, then up rows
    w_down: torch.Tensor,  # [num_experts, hidden_size, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]: each choice's routing weight
    topk_ids: torch.Tensor,  # int [num_tokens, top_k]: each choice's expert
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, j]``."""
    validate_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    inter = w_gate_up.shape[1] // 2

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(rows, w_gate_up[index])
        return torch.mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down[index].t())

    return grouped_experts(hidden, topk_weights, topk_ids, w_gate_up.shape[0], expert)


def grouped_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                    expert: ExpertFn) -> torch.Tensor:
    """The routed experts' weighted sum, each chosen expert called once, on its own rows (the rest of
    :func:`fused_moe_ref`, shared with CPU paths that compute an expert's GEMMs another way)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    choices = topk_ids.reshape(-1).long()
    order = torch.argsort(choices, stable=True)
    counts = torch.bincount(choices, minlength=num_experts).tolist()
    tokens = order // top_k
    # Rows grouped by expert: each expert's inputs and outputs are contiguous slices, gathered and scattered once.
    grouped = hidden[tokens]
    expert_out = torch.empty_like(grouped)
    start = 0
    for index, count in enumerate(counts):
        if count == 0:
            continue
        stop = start + count
        expert_out[start:stop] = expert(index, grouped[start:stop])
        start = stop
    # Rows are added in expert order, so each token sums its experts in ascending order (transformers' order).
    expert_out *= topk_weights.reshape(-1)[order].to(hidden.dtype)[:, None]
    return out.index_add_(0, tokens, expert_out)


def validate_moe_inputs(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """``ValueError`` naming the argument whose shape, dtype or device does not fit the others."""
    require_ndim("hidden", hidden, 2)
    require_ndim("w_gate_up", w_gate_up, 3)
    require_ndim("w_down", w_down, 3)
    require_ndim("topk_weights", topk_weights, 2)
    require_ndim("topk_ids", topk_ids, 2)
    for name, tensor in (("hidden", hidden), ("w_gate_up", w_gate_up), ("w_down", w_down),
                         ("topk_weights", topk_weights)):
        require_dtype(name, tensor, FLOAT_DTYPES)
    require_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    num_experts, double_inter, hidden_size = w_gate_up.shape
    if double_inter % 2:
        raise ValueError(f"w_gate_up must stack gate and up rows (an even dim 1), got shape {tuple(w_gate_up.shape)}")
    if hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden has width {hidden.shape[1]}, w_gate_up expects {hidden_size}")
    if tuple(w_down.shape) != (num_experts, hidden_size, double_inter // 2):
        raise ValueError(f"w_down has shape {tuple(w_down.shape)}, expected "
                         f"{(num_experts, hidden_size, double_inter // 2)} to match w_gate_up")
    if topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [num_tokens={hidden.shape[0]}, top_k]")
    if topk_ids.shape[1] > num_experts:
        raise ValueError(f"topk_ids picks {topk_ids.shape[1]} experts per token out of only {num_experts}")
    require_same_device(hidden.device, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights,
                        topk_ids=topk_ids)
