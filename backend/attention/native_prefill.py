"""The compiled paged prefill attention (``paged_prefill.c``), built once per machine and loaded with ctypes.

The torch path gathers every block of a prefill chunk's context into a buffer, in
every layer, and builds an additive mask for a chunk after cached context; the C
routine reads the blocks where they lie, a cache-sized tile of keys at a time for
a tile of query rows (see the source), so neither copy nor mask exists. Which
chunks it takes and which stay on torch SDPA is the plan's rule
(:func:`pagedllm.attention.cpu_attention_plan.native_prefill_wins`). How it is built
and cached: :mod:`pagedllm.platform.native_build`.

It shares ``PAGEDLLM_NATIVE_ATTENTION`` with the decode routine: "0", or no C
compiler, makes :func:`load_native_prefill` return ``None`` and every prefill runs
the torch path.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedllm.kernels.reference import FP8_DTYPES
from pagedllm.attention.cpu_attention_plan import NativePrefills
from pagedllm.platform.native_build import load_library
from pagedllm.attention.native_decode import SWITCH_ENV

__all__ = ["NativePrefill", "load_native_prefill"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_prefill.c")


class NativePrefill:
    """``pagedllm_paged_prefill_f32`` and ``pagedllm_paged_prefill_fp8`` with their argument types; see
    ``paged_prefill.c`` for the contracts."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        layout = [pointer, pointer, pointer, pointer, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int,
                  pointer]
        self._function = library.pagedllm_paged_prefill_f32
        self._function.restype = ctypes.c_int
        self._function.argtypes = [pointer, pointer, pointer, *layout]
        self._function_fp8 = library.pagedllm_paged_prefill_fp8
        self._function_fp8.restype = ctypes.c_int
        self._function_fp8.argtypes = [pointer, pointer, pointer, ctypes.c_int, ctypes.c_float, ctypes.c_float, *layout]
        lanes = library.pagedllm_paged_prefill_lanes
        lanes.restype, lanes.argtypes = ctypes.c_int, []
        # Built for AVX-512 (16-lane vectors), it beats SDPA on every chunk size measured; see native_prefill_wins.
        self.wide = lanes() >= 16

    def __call__(
        self,
        q: torch.Tensor,  # float32 contiguous [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # float32 or 8-bit, contiguous head-major [kv_heads, num_blocks, block_size, head_dim]
        v_cache: torch.Tensor,
        prefills: NativePrefills,
        scale: float,
        out: torch.Tensor,  # float32 contiguous, q's shape: the chunks' rows are written
        k_scale: float = 1.0,  # an 8-bit cache's scales
        v_scale: float = 1.0,
    ) -> None:
        kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        # C does not bound-check: a bad table would read outside the cache instead of raising.
        if prefills.lowest_block < 0 or prefills.highest_block >= num_blocks:
            raise ValueError(f"block table holds ids outside [0, {num_blocks})")
        if head_dim % 16 or q.shape[1] % kv_heads or q.shape[2] != head_dim:
            raise ValueError(f"paged prefill needs head_dim a multiple of 16 and whole groups: q {tuple(q.shape)}, "
                             f"cache {tuple(k_cache.shape)}")
        starts, query_lens, seq_lens, block_table = prefills.addresses
        layout = (starts, query_lens, seq_lens, block_table, prefills.block_table.shape[1], len(prefills.starts),
                  kv_heads, q.shape[1] // kv_heads, head_dim, num_blocks, block_size, scale, torch.get_num_threads(),
                  out.data_ptr())
        if k_cache.dtype in FP8_DTYPES:
            failed = self._function_fp8(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                        FP8_DTYPES.index(k_cache.dtype), k_scale, v_scale, *layout)
        else:
            failed = self._function(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *layout)
        if failed:
            raise MemoryError("paged prefill attention could not allocate its scratch space")


@functools.cache
def load_native_prefill() -> NativePrefill | None:
    """The compiled routine, built on first call; ``None`` (with one warning) when it cannot be."""
    library = load_library(SOURCE, SWITCH_ENV, "CPU prefill attention runs the plain-torch path", logger)
    return None if library is None else NativePrefill(library)
