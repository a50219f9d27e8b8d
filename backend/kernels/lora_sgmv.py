"""Triton-lang batched LoRA (SGMV shape): shrink ``x A^T`` and expand ``+= (x A^T) B^T`` over adapter segments.

One program handles a tile of one segment's tokens (read through ``token_indices``, so a segment need not be
contiguous in the batch) against one adapter slot's matrix; programs past their segment's end return at once.
Same contracts as :mod:`pagedllm.kernels.lora_reference`. The grid is (segments, max segment length / BLOCK_M,
output columns / BLOCK_N): the segment layout is data built once per step on the host, never a branch per request.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch_support import FLOAT_DTYPES, require_dtype, require_ndim, require_same_device, runnable

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _segment_matmul_kernel(
    x_ptr,  # [num_tokens, K] rows read through token_indices
    w_ptr,  # [num_slots, N, K]: each output column's row of the slot's matrix
    out_ptr,  # [num_tokens, N]
    token_indices_ptr, seg_starts_ptr, seg_slots_ptr,
    K, N,
    stride_xt, stride_xk,
    stride_ws, stride_wn, stride_wk,
    stride_ot, stride_on,
    ACCUMULATE: tl.constexpr,  # expand: out += result; shrink: out = result
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    segment = tl.program_id(0)
    start = tl.load(seg_starts_ptr + segment)
    length = tl.load(seg_starts_ptr + segment + 1) - start
    first = tl.program_id(1) * BLOCK_M
    if first >= length:
        return
    slot = tl.load(seg_slots_ptr + segment).to(tl.int64)
    offs_m = first + tl.arange(0, BLOCK_M)
    in_segment = offs_m < length
    tokens = tl.load(token_indices_ptr + start + offs_m, mask=in_segment, other=0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # tl.zeros is a jit function: not interpretable here
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                    mask=in_segment[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=in_n[None, :] & in_k[:, None], other=0.0).to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
    out_offsets = tokens[:, None] * stride_ot + offs_n[None, :] * stride_on
    mask = in_segment[:, None] & in_n[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptr + out_offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    out: torch.Tensor,
    token_indices: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> None:
    """``out[t] = x[t] @ lora_a[slot]^T`` per segment token (contract: ``lora_reference.lora_shrink_ref``)."""
    _validate(x, lora_a, out, token_indices, seg_starts, seg_slots)
    _launch(x, lora_a, out, token_indices, seg_starts, seg_slots, max_seg_len, accumulate=False)


def lora_expand(
    buffer: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    token_indices: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> None:
    """``y[t] += buffer[t] @ lora_b[slot]^T`` per segment token (contract: ``lora_reference.lora_expand_ref``)."""
    _validate(buffer, lora_b, y, token_indices, seg_starts, seg_slots)
    _launch(buffer, lora_b, y, token_indices, seg_starts, seg_slots, max_seg_len, accumulate=True)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, token_indices: torch.Tensor,
            seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int, accumulate: bool) -> None:
    num_segments = seg_slots.shape[0]
    if num_segments == 0 or max_seg_len == 0:
        return
    n, k = w.shape[1], w.shape[2]
    grid = (num_segments, triton.cdiv(max_seg_len, BLOCK_M), triton.cdiv(n, BLOCK_N))
    runnable(_segment_matmul_kernel, x.device)[grid](
        x, w, out, token_indices, seg_starts, seg_slots, k, n,
        *x.stride(), *w.stride(), *out.stride(),
        ACCUMULATE=accumulate, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def _validate(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, token_indices: torch.Tensor,
              seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    require_ndim("input", x, 2)
    require_ndim("lora weights", w, 3)
    require_ndim("output", out, 2)
    for name, tensor in (("input", x), ("lora weights", w), ("output", out)):
        require_dtype(name, tensor, FLOAT_DTYPES)
    for name, tensor in (("token_indices", token_indices), ("seg_starts", seg_starts), ("seg_slots", seg_slots)):
        require_dtype(name, tensor, (torch.int32,))
    require_same_device(x.device, lora_weights=w, output=out, token_indices=token_indices, seg_starts=seg_starts,
                        seg_slots=seg_slots)
    if w.shape[2] != x.shape[1] or out.shape[1] != w.shape[1] or out.shape[0] != x.shape[0]:
        raise ValueError(f"shapes do not chain: input {tuple(x.shape)}, lora weights {tuple(w.shape)} "
                         f"(slots, out, in), output {tuple(out.shape)}")
    if seg_starts.shape[0] != seg_slots.shape[0] + 1:
        raise ValueError(f"seg_starts has {seg_starts.shape[0]} entries for {seg_slots.shape[0]} segments; "
                         "expected one more")
