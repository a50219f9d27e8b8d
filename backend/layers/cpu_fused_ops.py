"""The fused elementwise steps of a layer on the CPU (``cpu_fused.c``), float32 or bf16, loaded with ctypes.

RMSNorm (with the residual add before it), the rotary embedding of q and k,
and SiLU-and-multiply are 3-8 torch ops each: a dispatch and a pass over memory
per op, ~15% of a small model's CPU step. vLLM's CPU backend fuses the same
steps (custom ops and torch.compile). Each is one call here, which also
releases the GIL. The library is built like the decode routine
(:mod:`pagedllm.platform.native_build`); without a compiler, or with
``PAGEDLLM_NATIVE_OPS=0``, the model keeps its plain-torch ops.

bf16 models (on a CPU that computes bf16, :mod:`pagedllm.platform.cpu_dtypes`) get all three on bf16
tensors, rounding where torch's bf16 ops round, so their outputs are torch's bit for bit. The
norm's sum of squares reproduces torch's own summation order (see ``cpu_fused.c``); that order is
torch's implementation, not its contract, so the library checks it against torch once, on load,
and a torch that sums otherwise keeps its own bf16 norm.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.platform.cpu_dtypes import native_cpu_dtypes
from pagedllm.platform.native_build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_fused.c")
SWITCH_ENV = "PAGEDLLM_NATIVE_OPS"  # "0": never build or load it


_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class CpuFusedOps:
    """The library's routines, for dense CPU tensors (every argument of one call in one dtype): RMSNorm, the
    rotary and SiLU-and-multiply in float32 or bf16; see ``cpu_fused.c`` for the arithmetic."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._rms_norm, self._rotary = {}, {}
        # Each called (gate_up, out, rows, width, threads): the bf16 routine with torch's silu table bound first.
        self._silu_mul: dict[torch.dtype, Callable[..., None]] = {}
        for dtype, suffix in _SUFFIXES.items():
            self._rms_norm[dtype] = library[f"pagedllm_rms_norm_{suffix}"]
            self._rms_norm[dtype].argtypes = [pointer, pointer, pointer, pointer, i64, i64, f32, i32]
            self._rms_norm[dtype].restype = None
            self._rotary[dtype] = library[f"pagedllm_rotary_{suffix}"]
            self._rotary[dtype].argtypes = [pointer, i64, pointer, pointer, i64, i64, i64, i32]
            silu_mul = library[f"pagedllm_silu_mul_{suffix}"]
            silu_mul.argtypes = [*([pointer] if dtype == torch.bfloat16 else []), pointer, pointer, i64, i64, i32]
            for routine in (self._rotary[dtype], silu_mul):
                routine.restype = None
            self._silu_mul[dtype] = silu_mul
        with torch.device("cpu"):  # the loader may build this while building the model on "meta"
            self._bf16_silu = _bf16_silu_table()  # held: the bf16 routine keeps its address
        self._silu_mul[torch.bfloat16] = functools.partial(self._silu_mul[torch.bfloat16], self._bf16_silu.data_ptr())
        self.norm_dtypes = frozenset({torch.float32} | ({torch.bfloat16} if self._bf16_norm_is_torchs() else set()))

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        """RMSNorm of ``x`` [rows, width]; with ``residual``, of ``residual += x`` (updated in place). x, residual
        and weight in one of :attr:`norm_dtypes`."""
        rows, width = x.shape
        # The C side trusts these sizes; a mismatch would read or write past a buffer.
        if weight.numel() != width or (residual is not None and residual.shape != x.shape):
            raise ValueError(f"rms_norm: x {tuple(x.shape)} needs a weight of {width} and a residual of the same "
                             f"shape, got {tuple(weight.shape)} and "
                             f"{None if residual is None else tuple(residual.shape)}")
        if x.dtype not in self._rms_norm:
            raise ValueError(f"rms_norm: expected float32 or bf16 rows, got {x.dtype}")
        dtype = x.dtype
        x = _dense(x.contiguous(), dtype)  # held here: the pointer must outlive the call
        out = torch.empty(rows, width, dtype=dtype)
        self._rms_norm[dtype](x.data_ptr(), None if residual is None else _dense(residual, dtype).data_ptr(),
                              _dense(weight, dtype).data_ptr(), out.data_ptr(), rows, width, eps,
                              torch.get_num_threads())
        return out

    def _bf16_norm_is_torchs(self) -> bool:
        """Whether the compiled bf16 RMSNorm gives torch's bf16 RMSNorm bit for bit here: rows of widths that
        take every branch of the summation order (short, a tail, levels carried), after a residual add."""
        with torch.device("cpu"):  # the loader may call this while building the model on "meta"
            return self._bf16_norm_probe_passes()

    def _bf16_norm_probe_passes(self) -> bool:
        generator = torch.Generator().manual_seed(0)
        for width in (8, 100, 896, 5000):
            x = (torch.randn(4, width, generator=generator) * 4).bfloat16()
            residual = (torch.randn(4, width, generator=generator) * 30).bfloat16()
            weight = (1 + torch.randn(width, generator=generator) / 10).bfloat16()
            h = (residual + x).float()
            expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
            stream = residual.clone()
            if not torch.equal(self._rms_norm_bf16(x, stream, weight), expected):
                logger.info("this torch sums rows in another order: bf16 RMSNorm keeps torch's ops")
                return False
        return True

    def _rms_norm_bf16(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self._rms_norm[torch.bfloat16](x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                       x.shape[0], x.shape[1], 1e-6, 1)
        return out

    def rotate_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate the first ``heads`` heads of each dense row of ``qkv`` in place; cos/sin [rows, (1,) head_dim]."""
        rows = qkv.shape[0]
        if qkv.dim() != 2 or heads * head_dim > qkv.shape[1] or head_dim % 2:
            raise ValueError(f"rotary: {heads} heads of {head_dim} (even) do not fit rows of {tuple(qkv.shape)}")
        if cos.numel() != rows * head_dim or sin.numel() != rows * head_dim:
            raise ValueError(f"rotary: cos/sin need {rows} x {head_dim} values (the whole head rotates), "
                             f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
        dtype = _dense(qkv).dtype
        # held: the pointers must outlive the call
        cos, sin = _dense(cos.contiguous(), dtype), _dense(sin.contiguous(), dtype)
        self._rotary[dtype](qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads,
                            head_dim, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for dense rows of ``[gate | up]``."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"silu_mul: expected rows of [gate | up] (even width), got {tuple(gate_up.shape)}")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=_dense(gate_up).dtype)
        self._silu_mul[out.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
        return out


def _bf16_silu_table() -> torch.Tensor:
    """torch's bf16 ``silu`` of every bf16 value, as float32, indexed by the value's 16 bits: the compiled bf16
    SiLU-and-multiply looks its gates up here, so its silu is torch's bit for bit at every gate."""
    every_bf16 = torch.arange(2**16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
    return F.silu(every_bf16).float()


def cpu_fused_ops(dtype: torch.dtype, device: torch.device) -> CpuFusedOps | None:
    """The fused ops for a model of ``dtype`` on ``device``: float32, or bf16 where the CPU computes it, on a
    CPU only, when they build."""
    if device.type != "cpu" or dtype not in _SUFFIXES or dtype not in native_cpu_dtypes():
        return None
    return _load()


@functools.cache
def _load() -> CpuFusedOps | None:
    library = load_library(SOURCE, SWITCH_ENV, "the model's elementwise steps run as plain torch ops", logger,
                           ("-ffp-contract=off",))
    return None if library is None else CpuFusedOps(library)


def _dense(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor``, checked to be a dense CPU tensor of ``dtype`` (any of the library's dtypes when ``None``)."""
    # The C side indexes rows by the stride it is given and everything else as dense.
    allowed = _SUFFIXES if dtype is None else (dtype,)
    if tensor.dtype not in allowed or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"expected a dense {' or '.join(str(d) for d in allowed)} CPU tensor, got {tensor.dtype} "
                         f"on {tensor.device}, strides {tensor.stride()}")
    return tensor
