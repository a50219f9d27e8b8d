"""The CPU attention backend over 8-bit KV caches: the compiled decode routine and the torch path read them
as the reference does, and the write quantizes as the reference does."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import unified_attention_ref, write_kv_ref
from pagedllm.kernels.reference import FP8_DTYPES, quantize_kv_ref
from pagedllm.testing.paged_batch import random_paged_batch
from pagedllm.worker.attention_backend import torch_backend
from pagedllm.worker.attention_metadata import AttentionMetadata
from pagedllm.worker.cpu_attention import new_cpu_cache
from pagedllm.worker.kv_quant import LayerKvScales, make_kv_scales
from pagedllm.worker.native_decode import load_native_decode

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
    torch.testing.assert_close(scales.k, torch.tensor([8.96 * 2 / 448]))
    torch.testing.assert_close(scales.v, torch.tensor([0.448 * 2 / 448]))
    assert make_kv_scales(2, torch.float32, torch.device("cpu"), calculate=True) is None
    with pytest.raises(ValueError, match="k_scale"):
        LayerKvScales(float("nan"), 1.0, torch.float8_e4m3fn, torch.device("cpu"), pending=False)
    with pytest.raises(ValueError, match="layers \\[1\\]"):
        make_kv_scales(2, torch.float8_e4m3fn, torch.device("cpu"), {0: (1.0, 1.0)})
