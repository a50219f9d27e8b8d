"""The compiled paged decode attention (``paged_decode.c``), built once per machine and loaded with ctypes.

Decode attention is the one place where plain torch cannot avoid copying: SDPA
needs each sequence's K/V contiguous, so the torch path gathers every block of
every decoding sequence into a buffer, in every layer, and then reads it again.
The C routine reads the blocks where they lie, once. How it is built and cached:
:mod:`pagedllm.platform.native_build`.

Without a compiler, or with ``PAGEDLLM_NATIVE_ATTENTION=0``, :func:`load_native_decode`
returns ``None`` and the plain-torch path runs instead, with a warning saying why.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedllm.kernels.reference import FP8_DTYPES
from pagedllm.attention.cpu_attention_plan import NativeDecodes
from pagedllm.platform.native_build import CACHE_ENV, load_library

__all__ = ["CACHE_ENV", "NativeDecode", "SWITCH_ENV", "load_native_decode"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
SWITCH_ENV = "PAGEDLLM_NATIVE_ATTENTION"  # "0": never build or load it


class NativeDecode:
    """``pagedllm_paged_decode_f32``, ``_fp8`` and ``_bf16`` and ``pagedllm_write_kv_f32`` with their argument
    types; see ``paged_decode.c`` for the contracts."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._function = library.pagedllm_paged_decode_f32
        self._function.restype = ctypes.c_int
        self._function.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, pointer, i64, i64, i64, i64, i64,
                                   i64, ctypes.c_float, i64, ctypes.c_int, pointer, pointer]
        self._function_fp8 = library.pagedllm_paged_decode_fp8
        self._function_fp8.restype = ctypes.c_int
        self._function_fp8.argtypes = [pointer, pointer, pointer, ctypes.c_int, ctypes.c_float, ctypes.c_float, pointer,
                                       pointer, i64, pointer, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                                       ctypes.c_int, pointer, pointer]
        self._function_bf16 = library.pagedllm_paged_decode_bf16
        self._function_bf16.restype = ctypes.c_int
        self._function_bf16.argtypes = self._function.argtypes
        self._write = library.pagedllm_write_kv_f32
        self._write.restype = i64
        self._write.argtypes = [pointer, pointer, i64, pointer, i64, i64, i64, i64, pointer, pointer]
        self._write_bf16 = library.pagedllm_write_kv_bf16
        self._write_bf16.restype = i64
        self._write_bf16.argtypes = self._write.argtypes
        self._write_fp8 = library.pagedllm_write_kv_fp8
        self._write_fp8.restype = i64
        self._write_fp8.argtypes = [pointer, pointer, i64, pointer, i64, i64, i64, i64, ctypes.c_int, ctypes.c_float,
                                    ctypes.c_float, pointer, pointer]

    def write_kv(
        self,
        key: torch.Tensor,  # float32 or bf16 [num_tokens, kv_heads, head_dim], heads dense within a row
        value: torch.Tensor,  # the same shape, dtype and row stride as key
        # float32 or 8-bit for float32 rows, bf16 for bf16 rows; contiguous head-major [kv_heads, num_blocks,
        # block_size, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]; negative = padded token, skipped
        k_scale: float = 1.0,  # an 8-bit cache's scales: it stores key / k_scale, saturated
        v_scale: float = 1.0,
    ) -> None:
        kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        # C trusts these sizes: a mismatch would read past the rows or write past the cache.
        if (key.shape[1:] != (kv_heads, head_dim) or value.shape != key.shape or value.stride() != key.stride()
                or value.dtype != key.dtype or (key.dtype == torch.bfloat16) != (k_cache.dtype == torch.bfloat16)
                or key.stride(2) != 1 or (kv_heads > 1 and key.stride(1) != head_dim) or v_cache.shape != k_cache.shape
                or slot_mapping.shape != (key.shape[0],)):
            raise ValueError(f"write_kv: key {tuple(key.shape)} / value {tuple(value.shape)} with strides "
                             f"{key.stride()} / {value.stride()} and {tuple(slot_mapping.shape)} slots do not "
                             f"match caches of {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
        slots = slot_mapping.to(torch.int64).contiguous()  # held: the pointer must outlive the call
        num_slots = num_blocks * block_size
        rows = (key.data_ptr(), value.data_ptr(), key.stride(0), slots.data_ptr(), len(slots), kv_heads, head_dim,
                num_slots)
        if k_cache.dtype in FP8_DTYPES:
            written = self._write_fp8(*rows, FP8_DTYPES.index(k_cache.dtype), k_scale, v_scale, k_cache.data_ptr(),
                                      v_cache.data_ptr())
        elif k_cache.dtype == torch.bfloat16:
            written = self._write_bf16(*rows, k_cache.data_ptr(), v_cache.data_ptr())
        else:
            written = self._write(*rows, k_cache.data_ptr(), v_cache.data_ptr())
        if written != len(slots):
            raise ValueError(f"slot_mapping holds slot {int(slots[written])}, outside the cache's {num_slots} slots")

    def __call__(
        self,
        q: torch.Tensor,  # contiguous [num_tokens, num_heads, head_dim]: bf16 for a bf16 cache, float32 otherwise
        k_cache: torch.Tensor,  # float32, 8-bit or bf16, contiguous head-major [kv_heads, num_blocks, block_size, head_dim]
        v_cache: torch.Tensor,
        decodes: NativeDecodes,
        scale: float,
        out: torch.Tensor,  # contiguous, q's shape and dtype: the decodes' rows are written
        lse: torch.Tensor,  # float32 contiguous [num_tokens, num_heads]: the decodes' rows are written
        k_scale: float = 1.0,  # an 8-bit cache's scales
        v_scale: float = 1.0,
    ) -> None:
        kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        # C does not bound-check: a bad table would read outside the cache instead of raising.
        if decodes.lowest_block < 0 or decodes.highest_block >= num_blocks:
            raise ValueError(f"block table holds ids outside [0, {num_blocks})")
        # ... nor look at dtypes: a bf16 cache's routine reads and writes two bytes a value, the others four.
        rows_dtype = torch.bfloat16 if k_cache.dtype == torch.bfloat16 else torch.float32
        if q.dtype != rows_dtype or out.dtype != rows_dtype:
            raise ValueError(f"a {k_cache.dtype} cache takes {rows_dtype} queries and outputs, got {q.dtype} and "
                             f"{out.dtype}")
        rows, block_table, lens = decodes.addresses
        layout = (rows, block_table, decodes.block_table.shape[1], lens, len(decodes.rows), kv_heads,
                  q.shape[1] // kv_heads, head_dim, num_blocks, block_size, scale, decodes.max_len,
                  torch.get_num_threads(), out.data_ptr(), lse.data_ptr())
        if k_cache.dtype in FP8_DTYPES:
            failed = self._function_fp8(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                        FP8_DTYPES.index(k_cache.dtype), k_scale, v_scale, *layout)
        elif k_cache.dtype == torch.bfloat16:
            failed = self._function_bf16(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *layout)
        else:
            failed = self._function(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *layout)
        if failed:
            raise MemoryError(f"paged decode attention could not allocate {4 * q.shape[1] * decodes.max_len} bytes "
                              "of scratch space")


@functools.cache
def load_native_decode() -> NativeDecode | None:
    """The compiled routine, built on first call; ``None`` (with one warning) when it cannot be."""
    library = load_library(SOURCE, SWITCH_ENV, "CPU decode attention runs the slower plain-torch path", logger)
    return None if library is None else NativeDecode(library)
