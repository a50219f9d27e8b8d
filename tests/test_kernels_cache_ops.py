"""Triton-lang write_kv and copy_blocks against their torch references (CPU interpreter),
and the package's lazy loading of triton."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedllm.attention.backends import select_attention_backend
from pagedllm.kernels import (
    copy_blocks,
    copy_blocks_ref,
    triton_backend_ops,
    unified_attention,
    write_kv,
    write_kv_ref,
)

CACHE_SHAPE = (6, 4, 2, 24)  # [num_blocks, block_size, num_kv_heads, head_dim]; 24: not a power of two


def _random_cache(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(CACHE_SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_scatters_like_reference_and_skips_padded_slots(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    # Strided views of one fused projection, as a model's qkv split hands them over.
    fused = torch.randn(5, 3 * 2 * 24, generator=generator).to(dtype)
    key = fused[:, 48:96].view(5, 2, 24)
    value = fused[:, 96:].view(5, 2, 24)
    slot_mapping = torch.tensor([3, -1, 22, 0, -1], dtype=torch.int64)
    k_cache, v_cache = _random_cache(dtype, 2), _random_cache(dtype, 3)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_expected, v_expected, slot_mapping)
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    # slot 22 = block 5, offset 2; the padded tokens left every other slot untouched
    assert torch.equal(k_cache[5, 2], key[2])
    others = [slot for slot in range(24) if slot not in (0, 3, 22)]
    assert torch.equal(k_cache.view(24, 2, 24)[others], _random_cache(dtype, 2).view(24, 2, 24)[others])


def test_write_kv_casts_to_the_cache_dtype_and_accepts_int32_slots() -> None:
    key = torch.randn(2, 2, 24)
    value = torch.randn(2, 2, 24)
    k_cache = torch.zeros(CACHE_SHAPE, dtype=torch.float16)
    v_cache = torch.zeros(CACHE_SHAPE, dtype=torch.float16)
    write_kv(key, value, k_cache, v_cache, torch.tensor([7, 9], dtype=torch.int32))
    assert torch.equal(k_cache[1, 3], key[0].half()) and torch.equal(v_cache[2, 1], value[1].half())


def test_write_kv_rejects_mismatched_rows() -> None:
    k_cache = torch.zeros(CACHE_SHAPE)
    with pytest.raises(ValueError, match="key rows"):
        write_kv(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), k_cache, k_cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(torch.zeros(2, 2, 24), torch.zeros(2, 2, 24), k_cache, k_cache.clone(), torch.tensor([0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_copies_every_layer_like_reference(dtype: torch.dtype) -> None:
    caches = [(_random_cache(dtype, 10 + layer), _random_cache(dtype, 20 + layer)) for layer in range(3)]
    expected = [(k.clone(), v.clone()) for k, v in caches]
    mapping = torch.tensor([[0, 3], [2, 5], [0, 4]], dtype=torch.int64)
    copy_blocks_ref(expected, mapping)
    copy_blocks(caches, mapping)
    for (k, v), (k_ref, v_ref) in zip(caches, expected):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(caches[2][1][5], caches[2][1][2])
    assert torch.equal(caches[1][0][1], _random_cache(dtype, 11)[1])  # not a destination: untouched


def test_copy_blocks_with_no_pairs_changes_nothing() -> None:
    caches = [(_random_cache(torch.float32, 0), _random_cache(torch.float32, 1))]
    copy_blocks(caches, torch.zeros(0, 2, dtype=torch.int64))
    assert torch.equal(caches[0][0], _random_cache(torch.float32, 0))


def test_copy_blocks_rejects_caches_of_different_shapes() -> None:
    caches = [(_random_cache(torch.float32, 0), torch.zeros(6, 4, 2, 8))]
    with pytest.raises(ValueError, match=r"kv_caches\[0\]\[1\]"):
        copy_blocks(caches, torch.tensor([[0, 1]]))


def test_backend_ops_are_the_public_kernels() -> None:
    assert triton_backend_ops() == (unified_attention, write_kv, copy_blocks)
    backend = select_attention_backend(torch.device("cpu"), use_triton=True)
    assert (backend.name, backend.write_kv) == ("triton", write_kv)


def test_importing_the_package_does_not_import_triton() -> None:
    probe = "import sys, pagedllm.kernels; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
