"""Triton-lang scatter of a step's new keys and values into the paged cache."""
from __future__ import annotations

import math

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

# Elements of one token's [num_kv_heads, head_dim] row copied per program.
MAX_CHUNK = 1024


@triton.jit
def write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # int [num_tokens]; negative = padded token
    k_scale_ptr,  # fp32 [1]: read only when QUANT
    v_scale_ptr,  # fp32 [1]: read only when QUANT
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    CHUNK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,  # 8-bit caches: store x / scale, saturated at FP8_MAX
    FP8_MAX: tl.constexpr,  # the format's largest value, mantissa bits and smallest normal exponent
    FP8_MANTISSA: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    valid = offs < ROW
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    key = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=valid)
    value = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=valid)
    k_dst = block * stride_kcb + in_block * stride_kcs + head * stride_kch + dim * stride_kcd
    v_dst = block * stride_vcb + in_block * stride_vcs + head * stride_vch + dim * stride_vcd
    if QUANT:
        # Saturate, then round to the 8-bit format's nearest value (ties to even) while still in float32, so the
        # cast below is exact: the same bits on a GPU and in triton's interpreter, whose fp8 casts round half up
        # without carrying into the exponent. Normal range: round the mantissa on the integer bits (a carry
        # moves the exponent); subnormal range: a fixed step, rounded to by adding and subtracting 1.5 * 2^23 steps.
        # (Written out twice: the interpreter cannot call a @triton.jit helper, see attention_kernel.)
        DROP: tl.constexpr = 23 - FP8_MANTISSA
        MAGIC: tl.constexpr = 1.5 * 2.0 ** (23 + FP8_MIN_EXP - FP8_MANTISSA)
        key = tl.clamp(key.to(tl.float32) / tl.load(k_scale_ptr), -FP8_MAX, FP8_MAX)
        bits = key.to(tl.uint32, bitcast=True)
        bits = ((bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) >> DROP) << DROP
        key = tl.where(tl.abs(key) < 2.0 ** FP8_MIN_EXP, (key + MAGIC) - MAGIC, bits.to(tl.float32, bitcast=True))
        value = tl.clamp(value.to(tl.float32) / tl.load(v_scale_ptr), -FP8_MAX, FP8_MAX)
        bits = value.to(tl.uint32, bitcast=True)
        bits = ((bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) >> DROP) << DROP
        value = tl.where(tl.abs(value) < 2.0 ** FP8_MIN_EXP, (value + MAGIC) - MAGIC,
                         bits.to(tl.float32, bitcast=True))
    tl.store(k_cache_ptr + k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=valid)
    tl.store(v_cache_ptr + v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=valid)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = padded token, skipped
    k_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit k_cache's scale (None: 1.0)
    v_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit v_cache's scale (None: 1.0)
) -> None:
    """Scatter this step's keys and values into their cache slots (``slot = block * block_size + offset``).

    Same contract as :func:`pagedllm.kernels.reference.write_kv_ref`. ``key`` and
    ``value`` may be strided views (e.g. slices of a fused QKV projection).
    """
    _validate(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quant = k_cache.dtype in FP8_DTYPES
    if quant:
        k_scale, v_scale = kv_scale_or_one(k_scale, key.device), kv_scale_or_one(v_scale, key.device)
    row = num_kv_heads * head_dim
    chunk = min(MAX_CHUNK, 1 << (row - 1).bit_length())
    runnable(write_kv_kernel, key.device)[(num_tokens, -(-row // chunk))](
        key, value, k_cache, v_cache, slot_mapping, k_scale if quant else key, v_scale if quant else key,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=head_dim, ROW=row, CHUNK=chunk, BLOCK_SIZE=k_cache.shape[1],
        QUANT=quant, **_fp8_format(k_cache.dtype),
    )


def _fp8_format(dtype: torch.dtype) -> dict[str, float | int]:
    """The kernel's description of an 8-bit format (placeholders for other caches)."""
    if dtype not in FP8_DTYPES:
        return {"FP8_MAX": 0.0, "FP8_MANTISSA": 0, "FP8_MIN_EXP": 0}
    info = torch.finfo(dtype)
    return {"FP8_MAX": info.max, "FP8_MANTISSA": int(-math.log2(info.eps)), "FP8_MIN_EXP": int(math.log2(info.tiny))}


def kv_scale_or_one(scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """An 8-bit cache's scale as the fp32 one-element tensor the kernels read."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != device:
        raise ValueError(f"KV scale must be one float32 value on {device}, got {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")
    return scale


def _validate(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    require_ndim("key", key, 3)
    require_ndim("k_cache", k_cache, 4)
    require_ndim("slot_mapping", slot_mapping, 1)
    for name, tensor in (("key", key), ("value", value)):
        require_dtype(name, tensor, FLOAT_DTYPES)
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache)):
        require_dtype(name, tensor, FLOAT_DTYPES + FP8_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    require_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"key rows {tuple(key.shape[1:])} do not match k_cache's [num_kv_heads, head_dim] "
                         f"{tuple(k_cache.shape[2:])}")
    if slot_mapping.numel() != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries, expected num_tokens = {key.shape[0]}")
    require_same_device(key.device, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
