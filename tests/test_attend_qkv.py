"""The CPU backend's attend_qkv: a decode step's K/V write and attention straight from fused q|k|v rows, bound
once per step, against the write_kv + attend it replaces (same bits, same caches)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedllm.attention.backends import AttentionBackend, torch_backend
from pagedllm.attention.cpu_attention import new_cpu_cache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.native_decode import load_native_decode
from pagedllm.testing.paged_batch import PagedBatch

from test_cpu_attention import CASES, make_batch, metadata_of

SEQ_LENS = (1, 16, 17, 300, 64, 95)


@pytest.fixture(autouse=True)
def _routine() -> None:
    if load_native_decode() is None:
        pytest.skip("the native routine cannot be built here")


def _decode_step(dtype: torch.dtype, seed: int = 0) -> tuple[PagedBatch, AttentionMetadata]:
    case = replace(CASES["decode-gqa4-d64-b16"], query_lens=(1,) * len(SEQ_LENS), seq_lens=SEQ_LENS, dtype=dtype)
    batch = make_batch(case, seed=seed)
    block_size = case.block_size
    last = batch.seq_lens.long() - 1  # each decode writes its newest position
    slots = batch.block_table.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    return batch, replace(metadata_of(batch), slot_mapping=slots)


def _caches(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    caches = []
    for cache in (batch.k_cache, batch.v_cache):
        stored = new_cpu_cache(tuple(cache.shape), cache.dtype, cache.device)
        caches.append(stored.copy_(cache))
    return caches[0], caches[1]


def _qkv(batch: PagedBatch, seed: int) -> torch.Tensor:
    tokens, heads, head_dim = batch.q.shape
    width = (heads + 2 * batch.k_cache.shape[2]) * head_dim
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(batch.q.dtype)


def _split_and_attend(backend: AttentionBackend, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      metadata: AttentionMetadata, scale: float, heads: int) -> torch.Tensor:
    """What a layer does without attend_qkv."""
    tokens, kv_heads, head_dim = qkv.shape[0], k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    backend.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    return backend.attend(q.view(tokens, heads, head_dim), k_cache, v_cache, metadata, scale).reshape(tokens, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layer_of_a_decode_step_gets_the_bits_and_caches_of_write_kv_and_attend(dtype: torch.dtype) -> None:
    batch, metadata = _decode_step(dtype)
    heads = batch.q.shape[1]
    fused, unfused = torch_backend(), torch_backend()
    assert fused.attend_qkv is not None
    planned, planned_unfused = fused.plan(metadata), unfused.plan(metadata)
    for layer in range(3):  # one binding serves every layer of the step, each with its own caches and rows
        caches, expected_caches = _caches(batch), _caches(batch)
        qkv = _qkv(batch, seed=layer)
        expected = _split_and_attend(unfused, qkv, *expected_caches, planned_unfused, batch.scale, heads)
        actual = fused.attend_qkv(qkv, *caches, planned, batch.scale, heads)
        assert actual is not None and actual.dtype == dtype
        assert torch.equal(actual, expected)
        assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])


def test_the_next_step_and_other_rows_are_bound_anew() -> None:
    """A new plan (the next step), or rows of another width under the same plan, must not reuse the binding
    (its sizes are what the compiled routine trusts)."""
    backend = torch_backend()
    for seed in (1, 2):
        batch, metadata = _decode_step(torch.bfloat16, seed=seed)
        planned = backend.plan(metadata)
        heads = batch.q.shape[1]
        for kv_heads_factor in (1, 2):  # a model with twice the KV heads, under the same plan
            shape = (batch.k_cache.shape[0], batch.k_cache.shape[1], 2 * kv_heads_factor, batch.k_cache.shape[3])
            k_cache, v_cache = (new_cpu_cache(shape, torch.bfloat16, torch.device("cpu")).normal_() for _ in "kv")
            expected_caches = (k_cache.clone(), v_cache.clone())
            other = batch.q.shape[0], (heads + 2 * shape[2]) * shape[3]
            qkv = torch.randn(other, generator=torch.Generator().manual_seed(seed)).bfloat16()
            reference = torch_backend()
            expected = _split_and_attend(reference, qkv, *expected_caches, reference.plan(metadata), batch.scale, heads)
            assert torch.equal(backend.attend_qkv(qkv, k_cache, v_cache, planned, batch.scale, heads), expected)


def _verification_step(dtype: torch.dtype) -> tuple[PagedBatch, AttentionMetadata]:
    """Decodes beside chunks of 5 and 8 new tokens after earlier context, as a speculative verification has."""
    case = replace(CASES["decode-gqa4-d64-b16"], query_lens=(1, 5, 8, 1), seq_lens=(30, 17, 300, 64), dtype=dtype)
    batch = make_batch(case, seed=3)
    block_size, starts = case.block_size, batch.query_start_loc.long()
    positions = torch.cat([torch.arange(seq_len - query_len, seq_len)
                           for query_len, seq_len in zip(case.query_lens, case.seq_lens)])
    owner = torch.repeat_interleave(torch.arange(len(case.query_lens)), starts[1:] - starts[:-1])
    table = batch.block_table.long()[owner]
    slots = table.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    return batch, replace(metadata_of(batch), slot_mapping=slots)


def test_a_verification_step_runs_each_new_token_as_a_decode_with_the_bits_of_write_kv_and_attend() -> None:
    batch, metadata = _verification_step(torch.float32)
    heads = batch.q.shape[1]
    fused, unfused = torch_backend(), torch_backend()
    caches, expected_caches = _caches(batch), _caches(batch)
    qkv = _qkv(batch, seed=4)
    expected = _split_and_attend(unfused, qkv, *expected_caches, unfused.plan(metadata), batch.scale, heads)
    actual = fused.attend_qkv(qkv, *caches, fused.plan(metadata), batch.scale, heads)
    assert actual is not None and torch.equal(actual, expected)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])


def test_steps_with_prefills_and_8_bit_caches_are_left_to_write_kv_and_attend() -> None:
    backend = torch_backend()
    # A prompt's first chunk (15 tokens over its own 15) beside decodes: a prefill, not decodes.
    batch = make_batch(replace(CASES["mixed-gqa4-d64-b16-bf16"], query_lens=(1, 15, 1)))
    caches = _caches(batch)
    mixed = backend.plan(metadata_of(batch))
    assert backend.attend_qkv(_qkv(batch, 0), *caches, mixed, batch.scale, batch.q.shape[1]) is None
    batch, metadata = _decode_step(torch.float32)
    fp8 = [new_cpu_cache(tuple(batch.k_cache.shape), torch.float8_e4m3fn, torch.device("cpu")) for _ in "kv"]
    assert backend.attend_qkv(_qkv(batch, 0), *fp8, backend.plan(metadata), batch.scale, batch.q.shape[1]) is None
