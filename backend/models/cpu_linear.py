"""Float32 linears on the CPU through oneDNN with weights packed once at load time.

``F.linear`` (MKL sgemm) is near this CPU's peak for prefill-sized inputs but
slow for the few rows a decode step has once most requests of a batch are done.
At 4 rows the small benchmark model's 512x3072 gate/up takes 0.35 ms with
``F.linear`` and 0.16 ms packed, its 512x8192 LM head 2.0 and 0.91 ms; packed is
1.1-1.2x faster at 32-2048 rows, and slower only for narrow shapes at a single
row (0.018 against 0.031 ms for the tiny model's qkv). Source: ``pagedllm bench
kernels`` on a CPU (docs/results/kernels-cpu.md), AMD EPYC, 1 thread.
vLLM's CPU backend packs its linears the same way.

The sums run in a different order from MKL's, so outputs differ from
``F.linear`` by float32 rounding (~3e-6 relative). The engine already feeds MKL
different row counts than transformers does, so bit equality was never given;
the token-exact tests, which allow exact top-two ties only, pass unchanged.
``PAGEDLLM_CPU_LINEAR=mkl`` keeps ``F.linear``.
"""
from __future__ import annotations

import os

import torch
from torch import nn

SWITCH_ENV = "PAGEDLLM_CPU_LINEAR"
CHOICES = ("onednn", "mkl")  # packed (the default), or plain F.linear


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's own blocked layout; float32 on the CPU only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # Not parameters: an opaque oneDNN tensor has no strides to save or load.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Packing pays for float32 on a CPU that torch's oneDNN serves, unless switched off."""
    choice = os.environ.get(SWITCH_ENV) or CHOICES[0]
    if choice not in CHOICES:
        raise ValueError(f"{SWITCH_ENV}={choice!r} is invalid: expected one of {', '.join(CHOICES)}")
    return (device.type == "cpu" and dtype == torch.float32 and choice == "onednn"
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linears(model: nn.Module) -> None:
    """Swap every ``nn.Linear`` under ``model`` for a :class:`PackedLinear`.

    The unpacked weights are dropped with their modules, so memory does not double.
    """
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
