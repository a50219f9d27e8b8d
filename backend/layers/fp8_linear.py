"""FP8-weight linears on FP8 tensor cores: ``torch._scaled_mm`` on e4m3 weights and e4m3 activations.

A compressed-tensors FP8 checkpoint stores each Linear's weight in e4m3 with one scale per
tensor or per output row, and says how its inputs are rounded: a static scale per tensor
(``input_scale``) or a dynamic one per token. On a CUDA device with FP8 tensor cores
(compute capability 8.9 and later: Ada, Hopper, Blackwell) :class:`Fp8Linear` keeps the
weight in 8 bits, rounds its input to e4m3 with that scale (saturated), and multiplies the two
with ``torch._scaled_mm``, which applies both scales to the fp32 accumulator. Elsewhere the
loader dequantizes the weights once instead (:mod:`pagedllm.layers.quantization`).

``_scaled_mm`` scales one of three ways, and :class:`Fp8Linear` picks at each call:

* **tensorwise** (one activation scale, one weight scale): any output dtype;
* **rowwise** (a scale per token and/or per output row): cuBLAS/CUTLASS support it for a bfloat16
  output on every FP8 GPU, other outputs only on some (sm90 with a recent cuBLAS), so only bfloat16;
* otherwise the product with unit scales in float32, then both scales applied (vLLM's fallback too).

A fused q|k|v or gate|up weight carries its parts' scales row by row, so parts quantized with
different per-tensor scales stay exact (no requantization to a common scale); their static input
scales (the same input, calibrated per module) become the largest of them, so nothing saturates
that did not in any part.
"""
from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# _scaled_mm's operands must have inner and output dimensions that are multiples of 16 (cuBLASLt's FP8 rule).
ALIGNMENT = 16
# A token whose activations are all zero still gets a positive scale (its row quantizes to zeros).
MIN_DYNAMIC_SCALE = 1.0 / (FP8_MAX * 512.0)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 matrices in hardware: CUDA with compute capability >= 8.9."""
    return (device.type == "cuda" and torch.cuda.is_available() and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def fits_scaled_mm(out_features: int, in_features: int) -> bool:
    """Whether a ``[out_features, in_features]`` weight meets ``_scaled_mm``'s shape rule."""
    return out_features % ALIGNMENT == 0 and in_features % ALIGNMENT == 0


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [tokens, features] in e4m3 and its scale: the static ``input_scale`` (one value), else one per token
    (the token's largest magnitude maps to e4m3's largest value). Values are saturated, as compressed-tensors does."""
    values = x.float()
    if input_scale is None:
        scale = (values.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_DYNAMIC_SCALE)
    else:
        scale = input_scale
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` in e4m3 (``weight_scale`` per output row) on FP8 tensor cores."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8Linear needs a 2-D {FP8_DTYPE} weight, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if weight_scale.numel() != self.out_features:
            raise ValueError(f"weight_scale has {weight_scale.numel()} values for {self.out_features} output rows")
        # _scaled_mm's second operand is column-major: the transpose of the row-major [out, in] weight.
        self.register_buffer("weight_t", weight.t(), persistent=False)
        row_scales = weight_scale.reshape(1, -1).float().contiguous()
        self.register_buffer("weight_scale", row_scales, persistent=False)  # [1, out]: rowwise's layout
        # One value when every row has the same scale (a per-tensor weight): tensorwise scaling is possible.
        uniform = bool((row_scales == row_scales[0, 0]).all())
        self.register_buffer("tensor_scale", row_scales[0, 0].clone() if uniform else None, persistent=False)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(out_dtype), requires_grad=False)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        quantized, scale_a = quantize_activations(rows, self.input_scale)
        if scale_a.dim() == 0 and self.tensor_scale is not None:
            out = torch._scaled_mm(quantized, self.weight_t, scale_a=scale_a, scale_b=self.tensor_scale,
                                   out_dtype=self.out_dtype)
        elif self.out_dtype == torch.bfloat16:
            # Rowwise wants [tokens, 1] and [1, out] float32 scales with unit inner strides (no broadcast views).
            per_token = scale_a.reshape(1, 1).repeat(rows.shape[0], 1) if scale_a.dim() == 0 else scale_a
            out = torch._scaled_mm(quantized, self.weight_t, scale_a=per_token, scale_b=self.weight_scale,
                                   out_dtype=self.out_dtype)
        else:
            one = self.weight_scale.new_ones(())
            product = torch._scaled_mm(quantized, self.weight_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
            out = (product * scale_a * self.weight_scale).to(self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """``W`` in float32 (for checks and references)."""
        return self.weight_t.t().float() * self.weight_scale.reshape(-1, 1)

    def extra_repr(self) -> str:
        activations = "dynamic per-token" if self.input_scale is None else "static"
        weights = "per-tensor" if self.tensor_scale is not None else "per-channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, weights=e4m3 {weights}, "
                f"activations={activations}, out_dtype={self.out_dtype}")
