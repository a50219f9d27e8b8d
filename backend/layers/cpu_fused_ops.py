"""The fused float32 elementwise steps of a layer on the CPU (``cpu_fused.c``), loaded with ctypes.

RMSNorm (with the residual add before it), the rotary embedding of q and k,
and SiLU-and-multiply are 3-8 torch ops each: a dispatch and a pass over memory
per op, ~15% of a small model's CPU step. vLLM's CPU backend fuses the same
steps (custom ops and torch.compile). Each is one call here, which also
releases the GIL. The library is built like the decode routine
(:mod:`pagedllm.platform.native_build`); without a compiler, or with
``PAGEDLLM_NATIVE_OPS=0``, the model keeps its plain-torch ops.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedllm.platform.native_build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_fused.c")
SWITCH_ENV = "PAGEDLLM_NATIVE_OPS"  # "0": never build or load it


class CpuFusedOps:
    """The library's three routines, for dense float32 CPU tensors; see ``cpu_fused.c`` for the arithmetic."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._rms_norm = library.pagedllm_rms_norm_f32
        self._rms_norm.argtypes = [pointer, pointer, pointer, pointer, i64, i64, f32, i32]
        self._rotary = library.pagedllm_rotary_f32
        self._rotary.argtypes = [pointer, i64, pointer, pointer, i64, i64, i64, i32]
        self._silu_mul = library.pagedllm_silu_mul_f32
        self._silu_mul.argtypes = [pointer, pointer, i64, i64, i32]
        for routine in (self._rms_norm, self._rotary, self._silu_mul):
            routine.restype = None

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        """RMSNorm of ``x`` [rows, width]; with ``residual``, of ``residual += x`` (updated in place)."""
        rows, width = x.shape
        # The C side trusts these sizes; a mismatch would read or write past a buffer.
        if weight.numel() != width or (residual is not None and residual.shape != x.shape):
            raise ValueError(f"rms_norm: x {tuple(x.shape)} needs a weight of {width} and a residual of the same "
                             f"shape, got {tuple(weight.shape)} and "
                             f"{None if residual is None else tuple(residual.shape)}")
        x = _dense(x.contiguous())  # held here: the pointer must outlive the call
        out = torch.empty(rows, width, dtype=torch.float32)
        self._rms_norm(x.data_ptr(), None if residual is None else _dense(residual).data_ptr(),
                       _dense(weight).data_ptr(), out.data_ptr(), rows, width, eps, torch.get_num_threads())
        return out

    def rotate_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate the first ``heads`` heads of each dense row of ``qkv`` in place; cos/sin [rows, (1,) head_dim]."""
        rows = qkv.shape[0]
        if qkv.dim() != 2 or heads * head_dim > qkv.shape[1] or head_dim % 2:
            raise ValueError(f"rotary: {heads} heads of {head_dim} (even) do not fit rows of {tuple(qkv.shape)}")
        if cos.numel() != rows * head_dim or sin.numel() != rows * head_dim:
            raise ValueError(f"rotary: cos/sin need {rows} x {head_dim} values (the whole head rotates), "
                             f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
        cos, sin = _dense(cos.contiguous()), _dense(sin.contiguous())  # held: the pointers must outlive the call
        self._rotary(_dense(qkv).data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads,
                     head_dim, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for dense rows of ``[gate | up]``."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"silu_mul: expected rows of [gate | up] (even width), got {tuple(gate_up.shape)}")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=torch.float32)
        self._silu_mul(_dense(gate_up).data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
        return out


def cpu_fused_ops(dtype: torch.dtype, device: torch.device) -> CpuFusedOps | None:
    """The fused ops for a model of ``dtype`` on ``device``: float32 on a CPU only, when they build."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return _load()


@functools.cache
def _load() -> CpuFusedOps | None:
    library = load_library(SOURCE, SWITCH_ENV, "the model's elementwise steps run as plain torch ops", logger,
                           ("-ffp-contract=off",))
    return None if library is None else CpuFusedOps(library)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    # The C side indexes rows by the stride it is given and everything else as dense.
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"expected a dense float32 CPU tensor, got {tensor.dtype} on {tensor.device}, "
                         f"strides {tensor.stride()}")
    return tensor
