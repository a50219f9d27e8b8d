"""Triton-lang copy-on-write block copies across every layer's cache in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch_support import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    require_dtype,
    require_ndim,
    runnable,
    require_same_device,
)
from pagedllm.kernels.reference import FP8_DTYPES

# Elements of one block copied per program.
MAX_CHUNK = 2048
# Blocks are copied as raw bits: an integer type of the element's width keeps every
# payload (including NaNs) intact and sidesteps bf16 handling in the interpreter.
_BITS_TYPE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def copy_blocks_kernel(
    cache_ptrs_ptr,  # int64 [2 * num_layers]: base addresses of every K and V cache
    block_mapping_ptr,  # int [num_pairs, 2]: (source block, destination block)
    stride_pair,
    stride_side,
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
    BITS_TYPE: tl.constexpr,
):
    cache = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(BITS_TYPE))
    src = tl.load(block_mapping_ptr + pair * stride_pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + pair * stride_pair + stride_side).to(tl.int64)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    valid = offs < BLOCK_NUMEL
    data = tl.load(base + src * BLOCK_NUMEL + offs, mask=valid)
    tl.store(base + dst * BLOCK_NUMEL + offs, data, mask=valid)


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
    block_mapping: torch.Tensor,  # int64 [num_pairs, 2]: (source block, destination block)
) -> None:
    """Copy-on-write: duplicate whole blocks in every layer's K and V cache.

    Same contract as :func:`pagedllm.kernels.reference.copy_blocks_ref`, with
    one restriction: no block may be both a source and a destination in one
    call (copy-on-write targets are freshly allocated, so they never are).
    All caches must be contiguous and share shape and dtype.
    """
    if block_mapping.numel() == 0 or not kv_caches:
        return
    caches = [cache for pair in kv_caches for cache in pair]
    _validate(caches, block_mapping)
    block_numel = caches[0][0].numel()
    chunk = min(MAX_CHUNK, 1 << (block_numel - 1).bit_length())
    cache_ptrs = torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64, device=caches[0].device)
    grid = (len(caches), block_mapping.shape[0], -(-block_numel // chunk))
    runnable(copy_blocks_kernel, caches[0].device)[grid](
        cache_ptrs, block_mapping, block_mapping.stride(0), block_mapping.stride(1),
        BLOCK_NUMEL=block_numel, CHUNK=chunk, BITS_TYPE=_BITS_TYPE[caches[0].element_size()],
    )


def _validate(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    require_ndim("block_mapping", block_mapping, 2)
    require_dtype("block_mapping", block_mapping, INDEX_DTYPES)
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2], got shape {tuple(block_mapping.shape)}")
    first = caches[0]
    require_ndim("kv_caches[0][0]", first, 4)
    require_dtype("kv_caches[0][0]", first, FLOAT_DTYPES + FP8_DTYPES)
    for index, cache in enumerate(caches):
        name = f"kv_caches[{index // 2}][{index % 2}]"
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise ValueError(f"{name} is {cache.dtype} {tuple(cache.shape)}, expected {first.dtype} {tuple(first.shape)}")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    require_same_device(first.device, block_mapping=block_mapping,
                        **{f"kv_caches[{i // 2}][{i % 2}]": cache for i, cache in enumerate(caches)})
