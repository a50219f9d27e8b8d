"""Triton-lang fused mixture-of-experts FFN: two grouped GEMMs over rows sorted and padded per expert.

The step's routed rows (``token * top_k + choice``) are grouped by expert and
padded per expert to ``BLOCK_M`` (:func:`align_tokens_by_expert`), so each
program multiplies one tile of one expert's rows by that expert's weights:

1. gate|up: ``silu(x W_gate^T) * (x W_up^T)``, both halves accumulated in the
   same program so the activation never leaves registers;
2. down: ``a W_down^T`` scaled by each row's routing weight;

then the ``top_k`` weighted rows of a token are summed. Padding rows and
experts no token chose cost nothing but the early exit of unused blocks.
Same contract as :func:`pagedllm.kernels.fused_moe_reference.fused_moe_ref`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.fused_moe_align import ExpertAlignment, align_tokens_by_expert
from pagedllm.kernels.fused_moe_reference import validate_moe_inputs
from pagedllm.kernels.launch_support import is_interpreted, runnable


@dataclass(frozen=True, slots=True)
class MoeTiles:
    block_m: int  # routed rows per program (each expert's rows are padded to a multiple of it)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int = 4


@triton.jit
def moe_gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    w_ptr,  # [num_experts, 2 * inter, hidden]
    out_ptr,  # [num_rows, inter]: silu(gate) * up per routed row
    sorted_rows_ptr,  # int32 [max_padded]
    block_experts_ptr,  # int32 [max_blocks]
    num_padded_ptr,  # int32 [1]
    num_rows, hidden, inter,
    stride_xt, stride_xh,
    stride_we, stride_wn, stride_wk,
    stride_or, stride_oc,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32: fp32 inputs, and the interpreter (its bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    tokens = rows // TOP_K
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_expert = w_ptr + expert * stride_we
    acc_gate = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xh,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_expert + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w_expert + (cols[None, :] + inter) * stride_wn + ks[:, None] * stride_wk, mask=w_mask,
                       other=0.0)
        if UPCAST:
            x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
    activated = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_oc,
             activated.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_down_kernel(
    a_ptr,  # [num_rows, inter]
    w_ptr,  # [num_experts, hidden, inter]
    out_ptr,  # [num_rows, hidden]: weighted expert output per routed row
    weights_ptr,  # [num_rows]: routing weight of each routed row
    sorted_rows_ptr,  # int32 [max_padded]
    block_experts_ptr,  # int32 [max_blocks]
    num_padded_ptr,  # int32 [1]
    num_rows, hidden, inter,
    stride_ar, stride_ac,
    stride_we, stride_wn, stride_wk,
    stride_or, stride_oc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32: fp32 inputs, and the interpreter (its bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_expert = w_ptr + expert * stride_we
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_ptr + rows[:, None] * stride_ar + ks[None, :] * stride_ac,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_expert + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_oc,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def moe_tiles(num_tokens: int, top_k: int, num_experts: int) -> MoeTiles:
    """Tiles for a step: the row block follows the mean rows per expert, so small decode batches pad little."""
    rows_per_expert = num_tokens * top_k / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 48 else 64
    return MoeTiles(block_m=block_m, block_n=64, block_k=64 if block_m < 64 else 32)


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden_size]: gate rows, then up rows
    w_down: torch.Tensor,  # [num_experts, hidden_size, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]: each choice's routing weight
    topk_ids: torch.Tensor,  # int [num_tokens, top_k]: each choice's expert
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, j]``."""
    num_tokens, top_k = topk_ids.shape
    return fused_moe_with_tiles(hidden, w_gate_up, w_down, topk_weights, topk_ids,
                                moe_tiles(num_tokens, top_k, w_gate_up.shape[0]))


def fused_moe_with_tiles(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles,
) -> torch.Tensor:
    """:func:`fused_moe` with explicit tiles (tests and benchmarks pick them)."""
    validate_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, double_inter, hidden_size = w_gate_up.shape
    inter = double_inter // 2
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    alignment = align_tokens_by_expert(topk_ids, num_experts, tiles.block_m)
    num_rows = alignment.num_rows
    activated = torch.empty(num_rows, inter, dtype=hidden.dtype, device=hidden.device)
    weighted = torch.empty(num_rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    gate_up_kernel = runnable(moe_gate_up_kernel, hidden.device)
    down_kernel = runnable(moe_down_kernel, hidden.device)
    upcast = hidden.dtype == torch.float32 or is_interpreted(gate_up_kernel)
    precision = "ieee" if upcast else "tf32"
    common = _alignment_args(alignment)
    gate_up_kernel[(alignment.max_blocks, triton.cdiv(inter, tiles.block_n))](
        hidden, w_gate_up, activated, *common, num_rows, hidden_size, inter,
        *hidden.stride(), *w_gate_up.stride(), *activated.stride(),
        TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        UPCAST=upcast, DOT_PRECISION=precision, num_warps=tiles.num_warps,
    )
    down_kernel[(alignment.max_blocks, triton.cdiv(hidden_size, tiles.block_n))](
        activated, w_down, weighted, topk_weights.reshape(-1).contiguous(), *common, num_rows, hidden_size, inter,
        *activated.stride(), *w_down.stride(), *weighted.stride(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        UPCAST=upcast, DOT_PRECISION=precision, num_warps=tiles.num_warps,
    )
    return weighted.view(num_tokens, top_k, hidden_size).sum(dim=1) if top_k > 1 else weighted


def _alignment_args(alignment: ExpertAlignment) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return alignment.sorted_rows, alignment.block_experts, alignment.num_padded
