"""8-bit KV cache: the Triton-lang write and attention (CPU interpreter) against references that quantize
the same way, and the references against plain full-precision attention over the dequantized cache."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import copy_blocks, unified_attention, unified_attention_ref, write_kv, write_kv_ref
from pagedllm.kernels.reference import FP8_DTYPES, dequantize_kv_ref, quantize_kv_ref
from pagedllm.testing.paged_batch import random_paged_batch

E4M3, E5M2 = FP8_DTYPES


def _scale(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_write_kv_quantizes_like_reference_and_saturates(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(5, 3 * 2 * 24, generator=generator) * 3
    key, value = fused[:, 48:96].view(5, 2, 24), fused[:, 96:].view(5, 2, 24)
    key[1, 0, 0], key[3, 1, 5], value[4, 0, 7] = 1e9, -1e9, float("inf")  # far past the format's range
    slot_mapping = torch.tensor([3, 17, -1, 0, 22], dtype=torch.int64)
    shape = (6, 4, 2, 24)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    k_scale, v_scale = _scale(0.05), _scale(0.5)
    write_kv_ref(key, value, k_expected, v_expected, slot_mapping, k_scale, v_scale)
    write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_expected.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_expected.view(torch.uint8))
    largest = torch.finfo(dtype).max
    # slot 17 = block 4 offset 1; slot 22 = block 5 offset 2: saturated, not inf or NaN
    assert float(k_cache[4, 1, 0, 0]) == largest and float(k_cache[0, 0, 1, 5]) == -largest
    assert float(v_cache[5, 2, 0, 7]) == largest
    assert torch.isfinite(k_cache.float()).all() and torch.isfinite(v_cache.float()).all()
    # an ordinary value lands within the format's rounding of key / scale
    stored = dequantize_kv_ref(k_cache[0, 3], k_scale, torch.float32)
    assert torch.allclose(stored, key[0], rtol=2 ** -2 if dtype == E5M2 else 2 ** -3, atol=1e-3)


def test_copy_blocks_copies_fp8_blocks_bit_for_bit() -> None:
    caches = [(torch.randn(4, 4, 2, 8).to(E4M3), torch.randn(4, 4, 2, 8).to(E4M3))]
    expected = caches[0][0][1].view(torch.uint8).clone()
    copy_blocks(caches, torch.tensor([[1, 3]]))
    assert torch.equal(caches[0][0][3].view(torch.uint8), expected)


def _quantized_batch(query_lens: tuple[int, ...], seq_lens: tuple[int, ...], num_heads: int, num_kv_heads: int,
                     block_size: int, dtype: torch.dtype, seed: int):
    batch = random_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, 32, block_size,
                               generator=torch.Generator().manual_seed(seed), spare_columns=1)
    k_scale, v_scale = _scale(0.02), _scale(0.01)
    return batch, quantize_kv_ref(batch.k_cache, k_scale, dtype), quantize_kv_ref(batch.v_cache, v_scale, dtype), \
        k_scale, v_scale


CASES = [
    # mixed prefill chunks (first and later) and decodes, GQA 4:1, block size 16
    pytest.param((5, 1, 1, 9), (5, 40, 17, 30), 8, 2, 16, E4M3, id="mixed-gqa4-bs16-e4m3"),
    # block size 32, GQA 2:1, the other format
    pytest.param((1, 7, 1), (33, 39, 64), 4, 2, 32, E5M2, id="mixed-gqa2-bs32-e5m2"),
]


@pytest.mark.parametrize("query_lens, seq_lens, num_heads, num_kv_heads, block_size, dtype", CASES)
def test_unified_attention_reads_fp8_like_reference(query_lens, seq_lens, num_heads, num_kv_heads, block_size,
                                                    dtype) -> None:
    batch, k8, v8, k_scale, v_scale = _quantized_batch(query_lens, seq_lens, num_heads, num_kv_heads, block_size,
                                                       dtype, seed=1)
    layout = (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale)
    expected = unified_attention_ref(batch.q, k8, v8, *layout, k_scale=k_scale, v_scale=v_scale)
    actual = unified_attention(batch.q, k8, v8, *layout, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # the reference reads an 8-bit cache exactly as full-precision attention over its dequantized values
    dense = unified_attention_ref(batch.q, dequantize_kv_ref(k8, k_scale, torch.float32),
                                  dequantize_kv_ref(v8, v_scale, torch.float32), *layout)
    torch.testing.assert_close(expected, dense, rtol=1e-5, atol=1e-5)


def test_unified_attention_fp8_split_kv_matches_single_pass() -> None:
    from pagedllm.kernels.attention_launch import unified_attention_with_splits

    batch, k8, v8, k_scale, v_scale = _quantized_batch((1, 1), (45, 20), 4, 1, 16, E4M3, seed=2)
    layout = (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale)
    single = unified_attention_with_splits(batch.q, k8, v8, *layout, num_splits=1, k_scale=k_scale, v_scale=v_scale)
    split = unified_attention_with_splits(batch.q, k8, v8, *layout, num_splits=3, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(split, single, rtol=1e-5, atol=1e-5)


def test_fp8_cache_rejects_a_malformed_scale() -> None:
    batch, k8, v8, _, _ = _quantized_batch((1,), (5,), 2, 1, 16, E4M3, seed=3)
    with pytest.raises(ValueError, match="KV scale"):
        unified_attention(batch.q, k8, v8, batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale,
                          k_scale=torch.ones(2), v_scale=torch.ones(1))
