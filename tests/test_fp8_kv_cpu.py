"""The CPU attention backend over 8-bit KV caches: the compiled decode routine and the torch path read them
as the reference does, and the write quantizes as the reference does."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kernels import unified_attention_ref, write_kv_ref
from pagedllm.kernels.reference import FP8_DTYPES, quantize_kv_ref
from pagedllm.testing.paged_batch import random_paged_batch
from pagedllm.attention.backends import torch_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.cpu_attention import new_cpu_cache
from pagedllm.attention.kv_quant import LayerKvScales, make_kv_scales
from pagedllm.attention.native_decode import load_native_decode

CASES = {
    # decodes only: the compiled routine reads every one in place, block by block
    "decode-gqa4-d64-b16": ((1, 1, 1, 1), (20, 17, 32, 70), 8, 2, 64, 16),
    # mixed prefill chunks (first and later) and decodes, head size the routine does not special-case
    "mixed-gqa2-d48-b32": ((1, 6, 1, 9), (40, 22, 90, 9), 4, 2, 48, 32),
}


def _metadata(batch) -> AttentionMetadata:
    query_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    return AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_table,
                             torch.zeros(sum(query_lens), dtype=torch.int64), max(query_lens),
                             int(batch.seq_lens.max()))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cpu_backend_reads_fp8_cache_like_reference(case, dtype: torch.dtype, native: bool) -> None:
    if native and load_native_decode() is None:
        pytest.skip("no C compiler: the compiled decode routine is not built")
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size = case
    batch = random_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                               generator=torch.Generator().manual_seed(0), spare_columns=1)
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.007])
    k8, v8 = quantize_kv_ref(batch.k_cache, k_scale, dtype), quantize_kv_ref(batch.v_cache, v_scale, dtype)
    expected = unified_attention_ref(batch.q, k8, v8, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                     batch.scale, k_scale=k_scale, v_scale=v_scale)
    backend = torch_backend(native=native)
    k_stored = new_cpu_cache(tuple(k8.shape), dtype, k8.device)
    v_stored = new_cpu_cache(tuple(v8.shape), dtype, v8.device)
    k_stored.view(torch.uint8).copy_(k8.view(torch.uint8))
    v_stored.view(torch.uint8).copy_(v8.view(torch.uint8))
    planned = backend.plan(_metadata(batch))
    for _ in range(2):  # the second call reuses the gather and dequantize buffers
        actual = backend.attend(batch.q, k_stored, v_stored, planned, batch.scale, k_scale, v_scale)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
def test_cpu_write_kv_quantizes_like_reference(dtype: torch.dtype) -> None:
    backend = torch_backend()
    shape = (5, 16, 2, 32)
    key, value = torch.randn(6, 2, 32) * 40, torch.randn(6, 2, 32)
    key[0, 0, 0] = 1e6  # saturates
    slots = torch.tensor([0, 17, -1, 33, 79, 5])
    k_scale, v_scale = torch.tensor([0.1]), torch.tensor([0.002])
    k_cache, v_cache = new_cpu_cache(shape, dtype, torch.device("cpu")), new_cpu_cache(shape, dtype, torch.device("cpu"))
    k_ref, v_ref = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    backend.write_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    write_kv_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    assert torch.equal(k_cache.contiguous().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.contiguous().view(torch.uint8), v_ref.view(torch.uint8))
    assert float(k_cache[0, 0, 0, 0]) == torch.finfo(dtype).max


def test_kv_scales_are_measured_once_with_headroom_and_checked() -> None:
    (scales,) = make_kv_scales(1, torch.float8_e4m3fn, torch.device("cpu"), calculate=True)
    assert scales.pending
    scales.measure(torch.full((3, 1, 4), -8.96), torch.full((3, 1, 4), 0.448))
    assert not scales.pending
    # The smallest power of two that maps twice the largest magnitude into e4m3's range (448).
    assert float(scales.k) == 2.0 ** -4  # 2 * 8.96 / 448 = 0.04 <= 1/16
    assert float(scales.v) == 2.0 ** -8  # 2 * 0.448 / 448 = 0.002 <= 1/256
    assert make_kv_scales(2, torch.float32, torch.device("cpu"), calculate=True) is None
    with pytest.raises(ValueError, match="k_scale"):
        LayerKvScales(float("nan"), 1.0, torch.float8_e4m3fn, torch.device("cpu"), pending=False)
    with pytest.raises(ValueError, match="layers \\[1\\]"):
        make_kv_scales(2, torch.float8_e4m3fn, torch.device("cpu"), {0: (1.0, 1.0)})


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
def test_a_measured_scale_stores_no_value_less_exactly_than_scale_one(dtype: torch.dtype) -> None:
    """The measured scale is a power of two: its grid holds 1.0's, and more points where 1.0 is subnormal."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(8192, generator=generator) * torch.logspace(-5, 1.3, 8192)  # |x| from 1e-6 to ~80
    (scales,) = make_kv_scales(1, dtype, torch.device("cpu"), calculate=True)
    scales.measure(values.view(-1, 1, 1), values.view(-1, 1, 1))
    assert float(scales.k) < 1.0 and math.log2(float(scales.k)).is_integer()
    measured = (quantize_kv_ref(values, scales.k, dtype).float() * scales.k - values).abs()
    unit = (quantize_kv_ref(values, 1.0, dtype).float() - values).abs()
    assert bool((measured <= unit).all())
    assert bool((measured < unit).any())  # the values 1.0 leaves subnormal
    normal = values.abs() >= torch.finfo(dtype).smallest_normal
    assert torch.equal(measured[normal], unit[normal])  # every normal value rounds as with 1.0


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [64, 20], ids=["vector", "scalar-tail"])
def test_compiled_decode_reads_every_byte_pattern_as_the_format_means_it(dtype: torch.dtype, head_dim: int) -> None:
    """Every finite 8-bit value, subnormals included, through both of the routine's dequantizing paths."""
    if load_native_decode() is None:
        pytest.skip("no C compiler: the compiled decode routine is not built")
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = patterns[torch.isfinite(patterns.view(dtype).float())]
    num_blocks, block_size = 4, 16
    count = num_blocks * block_size * head_dim
    stored = finite.repeat(-(-count // len(finite)))[torch.randperm(count, generator=torch.Generator().manual_seed(1))]
    k8 = stored.view(dtype).reshape(num_blocks, block_size, 1, head_dim)
    v8 = stored.flip(0).view(dtype).reshape(num_blocks, block_size, 1, head_dim)
    q = torch.randn(2, 2, head_dim) * 0.01  # small queries: no single key dominates the softmax
    query_start_loc, seq_lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([64, 37], dtype=torch.int32)
    block_table = torch.tensor([[3, 1, 0, 2], [2, 0, 1, 3]], dtype=torch.int32)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.25])
    expected = unified_attention_ref(q, k8, v8, query_start_loc, seq_lens, block_table, head_dim ** -0.5,
                                     k_scale=k_scale, v_scale=v_scale)
    k_cache = new_cpu_cache(tuple(k8.shape), dtype, torch.device("cpu"))
    v_cache = new_cpu_cache(tuple(v8.shape), dtype, torch.device("cpu"))
    k_cache.view(torch.uint8).copy_(k8.view(torch.uint8))
    v_cache.view(torch.uint8).copy_(v8.view(torch.uint8))
    backend = torch_backend()
    metadata = AttentionMetadata(query_start_loc, seq_lens, block_table, torch.zeros(2, dtype=torch.int64), 1, 64)
    actual = backend.attend(q, k_cache, v_cache, backend.plan(metadata), head_dim ** -0.5, k_scale, v_scale)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-3)  # values up to 1e4: fp32 sums


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
def test_compiled_write_rounds_every_magnitude_and_tie_as_torch_does(dtype: torch.dtype) -> None:
    if load_native_decode() is None:
        pytest.skip("no C compiler: the compiled write is not built")
    generator = torch.Generator().manual_seed(2)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    values = values[torch.isfinite(values)].sort().values
    ties = (values[1:] + values[:-1]) / 2  # exactly halfway: ties go to the even neighbour
    spread = torch.randn(4096, generator=generator) * torch.exp2(torch.randint(-24, 20, (4096,), generator=generator))
    rows = torch.cat([values, ties, spread, torch.tensor([1e30, -1e30])])
    rows = torch.cat([rows, rows.new_zeros(-len(rows) % 32)]).reshape(-1, 1, 32)
    shape = (rows.shape[0] // 16 + 1, 16, 1, 32)
    caches = [new_cpu_cache(shape, dtype, torch.device("cpu")) for _ in range(2)]
    expected = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    slots = torch.arange(rows.shape[0])
    scale = torch.tensor([1.0])
    torch_backend().write_kv(rows, rows, *caches, slots, scale, scale)
    write_kv_ref(rows, rows, *expected, slots, scale, scale)
    assert torch.equal(caches[0].contiguous().view(torch.uint8), expected[0].view(torch.uint8))
