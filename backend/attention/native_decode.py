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
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.kernels.reference import FP8_DTYPES
from pagedllm.attention.cpu_attention_plan import NativeDecodes
from pagedllm.platform.native_build import CACHE_ENV, load_library

__all__ = ["BoundDecodes", "CACHE_ENV", "NativeDecode", "SWITCH_ENV", "load_native_decode"]

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
        self._function.argtypes = [pointer, i64, pointer, pointer, pointer, pointer, i64, pointer, i64, i64, i64, i64,
                                   i64, i64, ctypes.c_float, i64, ctypes.c_int, pointer, pointer]
        self._function_fp8 = library.pagedllm_paged_decode_fp8
        self._function_fp8.restype = ctypes.c_int
        self._function_fp8.argtypes = [pointer, i64, pointer, pointer, ctypes.c_int, ctypes.c_float, ctypes.c_float,
                                       pointer, pointer, i64, pointer, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64,
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
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], heads dense within a row: bf16 for a bf16 cache,
        # float32 otherwise
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
        if q.stride()[1:] != (head_dim, 1):
            raise ValueError(f"the routine reads a query row's heads densely, got strides {q.stride()}")
        rows, block_table, lens = decodes.addresses
        layout = (rows, block_table, decodes.block_table.shape[1], lens, len(decodes.rows), kv_heads,
                  q.shape[1] // kv_heads, head_dim, num_blocks, block_size, scale, decodes.max_len,
                  torch.get_num_threads(), out.data_ptr(), lse.data_ptr())
        queries = (q.data_ptr(), q.stride(0))
        if k_cache.dtype in FP8_DTYPES:
            failed = self._function_fp8(*queries, k_cache.data_ptr(), v_cache.data_ptr(),
                                        FP8_DTYPES.index(k_cache.dtype), k_scale, v_scale, *layout)
        elif k_cache.dtype == torch.bfloat16:
            failed = self._function_bf16(*queries, k_cache.data_ptr(), v_cache.data_ptr(), *layout)
        else:
            failed = self._function(*queries, k_cache.data_ptr(), v_cache.data_ptr(), *layout)
        if failed:
            raise MemoryError(f"paged decode attention could not allocate {4 * q.shape[1] * decodes.max_len} bytes "
                              "of scratch space")


    def bind(self, decodes: NativeDecodes, slot_mapping: torch.Tensor, qkv: torch.Tensor, k_cache: torch.Tensor,
             num_heads: int, scale: float) -> BoundDecodes:
        """A decode-only step's write and attend, bound once for all its layers: see :class:`BoundDecodes`.
        ``qkv``, ``k_cache``: the first layer's, whose shapes every layer shares; caches as the module's callers
        see them ([num_blocks, block_size, kv_heads, head_dim], stored head-major), of ``qkv``'s dtype, float32 or
        bf16. ``ValueError`` where they do not fit together."""
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        tokens, width = qkv.shape
        head_major = (block_size * head_dim, head_dim, num_blocks * block_size * head_dim, 1)
        if (qkv.dtype not in (torch.float32, torch.bfloat16) or k_cache.dtype != qkv.dtype or num_heads % kv_heads
                or qkv.device.type != "cpu" or not qkv.is_contiguous() or k_cache.stride() != head_major
                or width != (num_heads + 2 * kv_heads) * head_dim or slot_mapping.shape != (tokens,)
                or decodes.lowest_block < 0 or decodes.highest_block >= num_blocks
                or int(decodes.rows.max()) >= tokens):
            raise ValueError(f"decodes of {num_heads} heads over rows of {tuple(qkv.shape)} and caches of "
                             f"{tuple(k_cache.shape)} ({k_cache.dtype}) do not fit together")
        bf16 = qkv.dtype == torch.bfloat16
        return BoundDecodes(self._function_bf16 if bf16 else self._function, self._write_bf16 if bf16 else self._write,
                            decodes, slot_mapping, qkv, k_cache, num_heads, scale)


class BoundDecodes:
    """One decode-only step's K/V write and attention for every layer, straight from the layer's fused q|k|v rows.

    Every layer of a decode step passes the routines the same block table, lengths, sizes and buffers; only its
    rows and caches differ. Deriving and checking those once per step instead of once per layer removes a few
    dozen Python-level operations from each layer, which at batch 1 cost more than the routine itself. The calls
    are the ones :meth:`NativeDecode.write_kv` and :meth:`NativeDecode.__call__` make, on the same values, with the
    queries read in place from q|k|v instead of from a dense copy: the same bits.
    """

    def __init__(self, decode: Callable[..., int], write: Callable[..., int], decodes: NativeDecodes,
                 slot_mapping: torch.Tensor, qkv: torch.Tensor, k_cache: torch.Tensor, num_heads: int,
                 scale: float) -> None:
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        tokens, width = qkv.shape
        self._decode, self._write = decode, write
        self._decodes = decodes  # held: the routine reads its arrays by address
        self._slots = slot_mapping.to(torch.int64).contiguous()  # held, likewise
        self.scale = scale
        self._rows = (qkv.shape, qkv.stride(), qkv.dtype, qkv.device)
        self._caches = (k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device)
        # Reused by every layer of the step: each layer's o_proj reads it before the next layer writes it.
        self.out = torch.empty(tokens, num_heads * head_dim, dtype=qkv.dtype)
        self._lse = torch.empty(tokens, num_heads, dtype=torch.float32)
        element = qkv.element_size()
        self._k_offset = num_heads * head_dim * element
        self._v_offset = self._k_offset + kv_heads * head_dim * element
        self._write_layout = (width, self._slots.data_ptr(), tokens, kv_heads, head_dim, num_blocks * block_size)
        rows, block_table, lens = decodes.addresses
        self._decode_layout = (rows, block_table, decodes.block_table.shape[1], lens, len(decodes.rows), kv_heads,
                               num_heads // kv_heads, head_dim, num_blocks, block_size, scale, decodes.max_len,
                               torch.get_num_threads(), self.out.data_ptr(), self._lse.data_ptr())

    def fits(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> bool:
        """Whether a layer's rows, caches and scale are those the step was bound for (C trusts them)."""
        caches = self._caches
        return ((qkv.shape, qkv.stride(), qkv.dtype, qkv.device) == self._rows and scale == self.scale
                and (k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device) == caches
                and (v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device) == caches)

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Write the layer's rotated K/V rows and attend its queries: [tokens, num_heads * head_dim] in :attr:`out`,
        valid until the next layer's call. The caller has checked :meth:`fits`."""
        rows, k, v = qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        written = self._write(rows + self._k_offset, rows + self._v_offset, *self._write_layout, k, v)
        if written != self._write_layout[2]:
            raise ValueError(f"slot_mapping holds slot {int(self._slots[written])}, outside the cache's "
                             f"{self._write_layout[5]} slots")
        if self._decode(rows, self._write_layout[0], k, v, *self._decode_layout):
            raise MemoryError("paged decode attention could not allocate its scratch space")
        return self.out


@functools.cache
def load_native_decode() -> NativeDecode | None:
    """The compiled routine, built on first call; ``None`` (with one warning) when it cannot be."""
    library = load_library(SOURCE, SWITCH_ENV, "CPU decode attention runs the slower plain-torch path", logger)
    return None if library is None else NativeDecode(library)
