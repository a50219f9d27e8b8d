"""CPU linears with weights packed once at load time: for oneDNN (float32 and bfloat16), MKL or our own GEMM (float32).

``F.linear`` (MKL sgemm) re-lays out the weight on every call and is slow for
the few rows a decode step has once most requests of a batch are done. Packing
the weight once for the GEMM library removes that work:

- ``native`` (the float32 default on a CPU with AVX2 but no AVX-512): our own GEMM on a
  weight packed in 16-column panels (:mod:`pagedllm.layers.native_gemm`). On such a CPU
  (an AMD EPYC of the Zen 3 kind), oneDNN runs the 1-64-row products of decode steps below
  both the core's FMA rate and its memory bandwidth; the packed panels run them faster,
  and prefill-sized products about level (``scripts/ab_fp32_linear.py``; RESULTS.md, "Our
  own float32 GEMM on the AVX2-only EPYC"). It is not measured against oneDNN's AVX-512
  kernels, so CPUs with AVX-512 keep oneDNN; the switch picks it anywhere it builds.
- ``onednn`` (the default elsewhere): torch's ``mkldnn._linear_pointwise`` on a oneDNN-packed
  weight, the packing vLLM's CPU backend uses. Over a model's whole body of float32
  linears, on the benchmark models' shapes and on Qwen2.5-0.5B's, it runs faster
  than MKL's packed GEMM at every row count from a few rows up to prefill sizes,
  and a little slower only for single-row steps, where its per-call setup is not
  hidden (measured: ``scripts/ab_fp32_linear.py``; RESULTS.md, "Figures behind the
  code's choices"). Each weight is packed once, for one library: two packings would
  double weight memory.
- ``mkl-packed``: MKL's packed GEMM (``cblas_sgemm_pack`` / ``cblas_sgemm_compute``),
  called through ctypes from the MKL that torch's own library exports; it releases
  the GIL. The fallback for float32 where torch was built without oneDNN.
- ``mkl``: plain ``F.linear``.

Packed results differ from ``F.linear`` by float32 rounding: the sums run in
another order. The engine already feeds MKL different row counts than transformers
does, so bit equality was never given; the token-exact tests, which allow exact
top-two ties only, pass with each of the four. ``PAGEDLLM_CPU_LINEAR`` picks one
of the four for float32.

bfloat16 linears (on a CPU that computes bf16 natively, :mod:`pagedllm.platform.cpu_dtypes`)
always take the oneDNN packing, unless ``PAGEDLLM_CPU_LINEAR=mkl`` keeps plain ``F.linear``:
MKL packs only float32, and a bf16 ``F.linear`` goes to oneDNN too but re-lays out its weight
on every call. Packed, the bf16 GEMMs of Qwen2.5-0.5B's shapes run faster at every row count
measured, with bit-identical results (``scripts/ab_bf16_linear.py``; RESULTS.md, "Figures behind
the code's choices").
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
from torch import nn

from pagedllm.layers.native_gemm import NativeGemm, load_native_gemm
from pagedllm.platform.cpu_dtypes import native_cpu_dtypes
from pagedllm.platform.cpu_memory import advise_huge_pages

logger = logging.getLogger(__name__)

SWITCH_ENV = "PAGEDLLM_CPU_LINEAR"
CHOICES = ("native", "onednn", "mkl-packed", "mkl")  # "mkl" is plain F.linear; the default: _float32_default

# CBLAS enum values (mkl_cblas.h).
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# The row count MKL is told to pack for; it picks the packed layout, not a limit. Packed for 32 rows,
# prefill-sized products ran ~10% slower; for 256 they run as fast as for 2048 and so do 8-32 rows.
_PACK_ROWS = 256


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` packed for a CPU GEMM library; on the CPU only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        # Not a parameter: a packed weight has no strides to save or load.
        self.bias = None if bias is None else bias.detach().contiguous()

    def unpacked_weight(self) -> torch.Tensor:
        """``W`` as [out, in], recovered exactly: every output of ``I W^T`` is one product by 1."""
        return self._product(torch.eye(self.in_features, dtype=self.dtype)).T.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x)
        return out if self.bias is None else out.add_(self.bias)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class MklPackedLinear(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        gemm = _mkl()
        if gemm is None:
            raise RuntimeError("this torch build exports no MKL packed GEMM (cblas_sgemm_pack)")
        self._gemm = gemm
        weight = weight.detach().contiguous()
        n, k = weight.shape
        size = gemm.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS, n, k)
        self.packed = torch.empty(size, dtype=torch.uint8)
        advise_huge_pages(self.packed)  # before packing writes it: every decode step streams it whole (cpu_memory)
        gemm.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS, n, k, 1.0, weight.data_ptr(), k,
                              self.packed.data_ptr())

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the MKL-packed linear takes float32 CPU input, got {x.dtype} on {x.device}")
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        if rows.shape[0]:
            self._gemm.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows.shape[0], self.out_features,
                                           self.in_features, rows.data_ptr(), self.in_features,
                                           self.packed.data_ptr(), self.out_features, 0.0, out.data_ptr(),
                                           self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)


class NativeLinear(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        gemm = load_native_gemm()
        if gemm is None:
            raise RuntimeError("the native float32 GEMM does not build on this machine (see the warning above)")
        self._gemm: NativeGemm = gemm
        self.packed = torch.empty(gemm.packed_numel(self.out_features, self.in_features), dtype=torch.float32)
        advise_huge_pages(self.packed)  # before packing writes it, as for MKL's packing
        gemm.pack(weight.detach(), self.packed)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm.product(x, self.packed, self.in_features, self.out_features)


class OneDnnLinear(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias inside the GEMM: rounded once, so bf16 outputs equal F.linear's bit for bit.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def packed_linear_choice(dtype: torch.dtype, device: torch.device) -> str | None:
    """The packed library CPU linears of ``dtype`` use here, or ``None`` for plain ``F.linear``.

    ``ValueError`` for an unknown ``PAGEDLLM_CPU_LINEAR``.
    """
    chosen = os.environ.get(SWITCH_ENV)
    if chosen and chosen not in CHOICES:
        raise ValueError(f"{SWITCH_ENV}={chosen!r} is invalid: expected one of {', '.join(CHOICES)}")
    if device.type != "cpu" or chosen == "mkl":
        return None
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if dtype == torch.bfloat16:
        # oneDNN's bf16 packing needs a CPU that computes bf16 (its reorder refuses otherwise).
        return "onednn" if onednn and torch.bfloat16 in native_cpu_dtypes() else None
    if dtype != torch.float32:
        return None
    choice = chosen or _float32_default()
    if choice == "native" and load_native_gemm() is None:
        choice = "onednn"  # load_native_gemm has warned
    if choice == "onednn" and not onednn:
        choice = "mkl-packed" if _mkl() is not None else None
        logger.warning("torch has no oneDNN packed linear here: float32 CPU linears use %s",
                       "MKL's packed GEMM" if choice else "F.linear")
    elif choice == "mkl-packed" and _mkl() is None:
        choice = "onednn" if onednn else None
        logger.warning("torch exports no MKL packed GEMM here: float32 CPU linears use %s",
                       "oneDNN" if choice else "F.linear")
    return choice


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, choice: str) -> PackedLinear:
    """``weight`` (and ``bias``) packed for ``choice``, one of :func:`packed_linear_choice`'s answers."""
    kinds: dict[str, type[PackedLinear]] = {"native": NativeLinear, "mkl-packed": MklPackedLinear}
    return kinds.get(choice, OneDnnLinear)(weight, bias)


def pack_linears(model: nn.Module, choice: str) -> None:
    """Swap every ``nn.Linear`` under ``model`` for a :class:`PackedLinear` of ``choice``.

    The unpacked weights are dropped with their modules, so memory does not double.
    """
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, packed_linear(child.weight, child.bias, choice))


def _float32_default() -> str:
    """``native`` where the CPU has AVX2 but not AVX-512, the kind of CPU it was measured faster on; else
    ``onednn``."""
    def probe(name: str) -> bool:
        found = getattr(torch.cpu, name, None)
        return bool(found()) if found is not None else False

    return "native" if probe("_is_avx2_supported") and not probe("_is_avx512_supported") else "onednn"


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """MKL's packed GEMM, from the library torch already loaded; ``None`` where torch has no MKL."""
    if not torch.backends.mkl.is_available():
        return None
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        mkl = ctypes.CDLL(str(library))
        mkl.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    except (OSError, AttributeError):
        return None
    # MKL's LP64 interface: every MKL_INT is a C int.
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    mkl.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
    mkl.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    mkl.cblas_sgemm_pack.restype = None
    mkl.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    mkl.cblas_sgemm_compute.restype = None
    return mkl
