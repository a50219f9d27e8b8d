"""The compiled bf16 prefill attention on AMX tiles (``paged_prefill_bf16.c``), built once per machine, loaded by
ctypes.

bf16 prefill chunks otherwise gather their blocks and run torch's bf16 SDPA; this routine reads the
bf16 cache in place and computes both matrix products on the CPU's AMX tiles, with float32 sums and the
softmax in float32 (see the source). It is not bit-identical to SDPA (other summation order), so it is
judged as bf16 is: greedy tokens and teacher-forced top-1 against transformers' bf16 forward
(tests/test_bf16_accuracy.py), and a float32 reference within a tolerance (tests/test_native_prefill_bf16.py).

:func:`load_native_prefill_bf16` returns ``None`` (and bf16 prefills keep SDPA) where the routine cannot
run: no C compiler, ``PAGEDLLM_NATIVE_ATTENTION=0`` (shared with the other compiled routines), a CPU
without AMX-BF16, or a kernel that refuses the process AMX tile state.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedllm.attention.cpu_attention_plan import NativePrefills
from pagedllm.attention.native_decode import SWITCH_ENV
from pagedllm.platform.native_build import load_library

__all__ = ["NativePrefillBf16", "load_native_prefill_bf16"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_prefill_bf16.c")
MAX_HEAD_DIM = 512  # the routine's per-row staging buffer


class NativePrefillBf16:
    """``pagedllm_paged_prefill_bf16`` with its argument types; see ``paged_prefill_bf16.c`` for the contract."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._function = library.pagedllm_paged_prefill_bf16
        self._function.restype = ctypes.c_int
        self._function.argtypes = [pointer, i64, pointer, pointer, pointer, pointer, pointer, pointer, i64, i64, i64,
                                   i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, pointer]

    @staticmethod
    def fits(head_dim: int, block_size: int) -> bool:
        """Whether the routine takes these shapes: whole 32-wide bf16 tile rows per head, whole 16-key groups
        per block."""
        return head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM and block_size % 16 == 0

    def __call__(
        self,
        q: torch.Tensor,  # bf16 [num_tokens, num_heads, head_dim], heads dense within a row (any row stride)
        k_cache: torch.Tensor,  # bf16, contiguous head-major [kv_heads, num_blocks, block_size, head_dim]
        v_cache: torch.Tensor,
        prefills: NativePrefills,
        scale: float,
        out: torch.Tensor,  # bf16 contiguous, q's shape: the chunks' rows are written
    ) -> None:
        kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        # C does not bound-check: a bad table would read outside the cache instead of raising.
        if prefills.lowest_block < 0 or prefills.highest_block >= num_blocks:
            raise ValueError(f"block table holds ids outside [0, {num_blocks})")
        if (not self.fits(head_dim, block_size) or q.shape[1] % kv_heads or q.shape[2] != head_dim
                or q.stride()[1:] != (head_dim, 1) or not out.is_contiguous() or out.shape != q.shape):
            raise ValueError(f"bf16 paged prefill needs head_dim a multiple of 32 (at most {MAX_HEAD_DIM}), "
                             f"block_size a multiple of 16, whole groups and dense heads: q {tuple(q.shape)} "
                             f"strides {q.stride()}, cache {tuple(k_cache.shape)}")
        starts, query_lens, seq_lens, block_table = prefills.addresses
        failed = self._function(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), starts, query_lens,
                                seq_lens, block_table, prefills.block_table.shape[1], len(prefills.starts), kv_heads,
                                q.shape[1] // kv_heads, head_dim, num_blocks, block_size, scale,
                                torch.get_num_threads(), out.data_ptr())
        if failed:
            raise MemoryError("bf16 paged prefill attention could not allocate its scratch space")


@functools.cache
def load_native_prefill_bf16() -> NativePrefillBf16 | None:
    """The compiled routine, built on first call; ``None`` where it cannot run here (see the module doc)."""
    library = load_library(SOURCE, SWITCH_ENV, "bf16 prefill attention runs torch's SDPA", logger)
    if library is None:
        return None
    ready = library.pagedllm_prefill_bf16_ready
    ready.restype, ready.argtypes = ctypes.c_int, []
    if not ready():
        logger.info("no AMX-BF16 tiles for this process: bf16 prefill attention runs torch's SDPA")
        return None
    return NativePrefillBf16(library)
