"""The compiled float32 GEMM on a pre-packed weight (``packed_gemm_f32.c``), for CPUs with AVX2 and FMA.

:mod:`pagedllm.layers.cpu_linear` says where its linears use it. The library is built
like the other compiled routines (:mod:`pagedllm.platform.native_build`): once per machine,
with the machine's C compiler. On a CPU without AVX2 and FMA it does not compile, and
:func:`load_native_gemm` returns ``None`` with one warning.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedllm.platform.native_build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("packed_gemm_f32.c")
PANEL = 16  # output columns per packed panel (NR in the source)


class NativeGemm:
    """``pagedllm_gemm_pack_f32`` and ``pagedllm_gemm_f32`` with their argument types and the checks C trusts."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._pack = library.pagedllm_gemm_pack_f32
        self._pack.argtypes = [pointer, i64, i64, pointer, i32]
        self._pack.restype = None
        self._gemm = library.pagedllm_gemm_f32
        self._gemm.argtypes = [pointer, i64, i64, pointer, i64, pointer, i32]
        self._gemm.restype = i32

    @staticmethod
    def packed_numel(out_features: int, in_features: int) -> int:
        """Floats in the packed form of an [out_features, in_features] weight: whole 16-column panels."""
        return -(-out_features // PANEL) * PANEL * in_features

    def pack(self, weight: torch.Tensor, packed: torch.Tensor) -> None:
        """``weight`` (float32 [out, in]) into ``packed``, a float32 buffer of :meth:`packed_numel` floats."""
        out_features, in_features = weight.shape
        if (weight.dtype != torch.float32 or packed.dtype != torch.float32 or not packed.is_contiguous()
                or packed.numel() != self.packed_numel(out_features, in_features)):
            raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight into a {packed.dtype} "
                             f"buffer of {packed.numel()} elements")
        weight = weight.contiguous()
        self._pack(weight.data_ptr(), out_features, in_features, packed.data_ptr(), torch.get_num_threads())

    def product(self, x: torch.Tensor, packed: torch.Tensor, in_features: int, out_features: int) -> torch.Tensor:
        """``x W^T`` for float32 CPU ``x`` [..., in_features], W [out_features, in_features] as :meth:`pack` left
        it in ``packed``."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the native float32 linear takes float32 CPU input, got {x.dtype} on {x.device}")
        if packed.numel() != self.packed_numel(out_features, in_features):
            raise ValueError(f"a packed buffer of {packed.numel()} elements is no [{out_features}, {in_features}] weight")
        if x.shape[-1] != in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the weight {in_features}")
        rows = x.reshape(-1, in_features).contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        if self._gemm(rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(), out_features, out.data_ptr(),
                      torch.get_num_threads()) != 0:
            raise MemoryError("the native float32 linear could not allocate its scratch rows")
        return out.reshape(*x.shape[:-1], out_features)


@functools.cache
def load_native_gemm() -> NativeGemm | None:
    """The compiled GEMM, built on first call; ``None`` (with one warning) when it cannot be."""
    library = load_library(SOURCE, None, "float32 CPU linears use oneDNN", logger)
    return None if library is None else NativeGemm(library)
