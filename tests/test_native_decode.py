"""The compiled paged decode routine: how it is built and loaded, what it refuses, and that the backend
sends it every float32 decode (its numbers against the reference are in test_cpu_attention.py)."""
from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pagedllm.kernels import unified_attention_ref
from pagedllm.attention import native_decode
from pagedllm.attention.backends import torch_backend
from pagedllm.attention.cpu_attention import CpuPagedAttention, new_cpu_cache, write_kv_cpu
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.cpu_attention_plan import plan_cpu_attention
from pagedllm.attention.native_decode import load_native_decode
from pagedllm.attention.native_prefill import load_native_prefill
from pagedllm.attention.native_prefill_bf16 import load_native_prefill_bf16
from pagedllm.testing.paged_batch import PagedBatch

from test_cpu_attention import CASES, TOLERANCE, Case, head_major, make_batch, metadata_of


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Each call builds or refuses anew, into a private cache. The prefill routines' loaders are cleared after
    too: a backend built here without a compiler would otherwise leave them ``None`` for every later test."""
    monkeypatch.setenv(native_decode.CACHE_ENV, str(tmp_path))
    load_native_decode.cache_clear()
    yield
    for loader in (load_native_decode, load_native_prefill, load_native_prefill_bf16):
        loader.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_it_builds_once_and_is_reused(fresh_load: None, tmp_path: Path) -> None:
    assert load_native_decode() is not None
    [built] = tmp_path.glob("paged_decode-*.so")
    stamp = built.stat().st_mtime_ns
    load_native_decode.cache_clear()
    assert load_native_decode() is not None
    assert list(tmp_path.glob("paged_decode-*.so")) == [built] and built.stat().st_mtime_ns == stamp


def test_switched_off_it_is_never_built(fresh_load: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_decode.SWITCH_ENV, "0")
    assert load_native_decode() is None
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"], ids=["missing", "failing"])
def test_without_a_working_compiler_the_torch_path_runs_and_says_why(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, compiler: str
) -> None:
    monkeypatch.setenv("CC", compiler)
    with caplog.at_level(logging.WARNING, logger=native_decode.__name__):
        assert load_native_decode() is None
    assert "plain-torch path" in caplog.text
    batch = make_batch(CASES["decode-gqa4-d64-b16"])
    batch = replace(batch, k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache))
    backend = torch_backend()
    planned = backend.plan(metadata_of(batch))
    actual = backend.attend(batch.q, batch.k_cache, batch.v_cache, planned, batch.scale)
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=1e-5, rtol=0)
    assert planned.plan.layouts and all(layout.native_decodes is None for layout in planned.plan.layouts.values())


@pytest.fixture
def routine() -> native_decode.NativeDecode:
    built = load_native_decode()
    if built is None:
        pytest.skip("the native routine cannot be built here")
    return built


def test_decodes_and_short_chunks_go_to_it_unbatched_and_only_prompts_are_gathered(
        routine: native_decode.NativeDecode) -> None:
    # Decodes at tokens 0 and 11; at 1, 6 new tokens after 16 of context; at 7, a prompt's first 4 tokens.
    case = CASES["mixed-gqa8-d96-b16"]
    batch = make_batch(case)
    layout = torch_backend().plan(metadata_of(batch)).plan.layout(case.block_size, case.dtype, True)
    assert layout.native_decodes is not None and not layout.decodes
    # Each of the 6 is a decode over the context up to itself (in the routine's order, by query row here).
    decodes = layout.native_decodes
    by_row = sorted(zip(decodes.rows.tolist(), decodes.lens.tolist(), decodes.block_table.tolist()))
    assert [row for row, _, _ in by_row] == [0, 1, 2, 3, 4, 5, 6, 11]
    assert [length for _, length, _ in by_row] == [case.seq_lens[0], 17, 18, 19, 20, 21, 22, case.seq_lens[3]]
    assert [table for row, _, table in by_row if 1 <= row <= 6] == [batch.block_table[1].tolist()] * 6
    assert [chunk.start for chunk in layout.prefills] == [7]
    assert layout.block_ids.numel() == -(-case.seq_lens[2] // case.block_size)


@pytest.mark.parametrize("threads", [1, 2])
def test_it_matches_the_reference_on_long_scattered_contexts(routine: native_decode.NativeDecode,
                                                             threads: int) -> None:
    seq_lens = (1, 16, 17, 700, 1500, 333, 64, 900)
    case = replace(CASES["decode-gqa4-d64-b16"], query_lens=(1,) * len(seq_lens), seq_lens=seq_lens)
    batch = make_batch(case, seed=9)
    batch = replace(batch, k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache))
    backend = torch_backend()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = backend.attend(batch.q, batch.k_cache, batch.v_cache, backend.plan(metadata_of(batch)), batch.scale)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=1e-5, rtol=0)
    # A step of decodes only is read in place: no layer gathers a block.
    assert not [key for key in backend.attend.__self__._buffers if key[0] in ("k", "v")]


def test_bf16_decodes_are_read_in_place_and_weighted_as_torch_bf16_attention_does(
        routine: native_decode.NativeDecode) -> None:
    seq_lens = (1, 16, 17, 700, 333, 64)
    case = replace(CASES["decode-gqa4-d64-b16"], query_lens=(1,) * len(seq_lens), seq_lens=seq_lens,
                   dtype=torch.bfloat16)
    batch = make_batch(case, seed=9)
    batch = replace(batch, k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache))
    backend = torch_backend()
    actual = backend.attend(batch.q, batch.k_cache, batch.v_cache, backend.plan(metadata_of(batch)), batch.scale)
    assert actual.dtype == torch.bfloat16
    # Sums in float32 in another order than the reference's float64 can move a result by one bf16 step.
    torch.testing.assert_close(actual.float(), _bf16_flash_reference(batch), rtol=2**-7, atol=1e-6)
    assert not [key for key in backend.attend.__self__._buffers if key[0] in ("k", "v")]


def test_a_bf16_step_with_prompts_runs_its_decodes_in_it_as_a_step_of_decodes_does(
        routine: native_decode.NativeDecode) -> None:
    # Decodes at tokens 0 and 25; a prompt's first 12 tokens at 1; 9 new tokens after 31 of context at 13 (a
    # prefill: more than MAX_CHUNK_AS_DECODES); 3 new tokens after 17 at 22 (three decodes).
    case = Case((1, 12, 9, 3, 1), (30, 12, 40, 20, 90), 14, 2, 64, 16, torch.bfloat16)
    batch = make_batch(case, seed=3)
    batch = replace(batch, k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache))
    backend = torch_backend()
    mixed = backend.attend(batch.q, batch.k_cache, batch.v_cache, backend.plan(metadata_of(batch)), batch.scale)
    # The decodes are read in place; so are the prefills where the AMX routine runs them, else only the two
    # prefills' blocks (1 + 3) are gathered.
    gathered = [buffer for key, buffer in backend.attend.__self__._buffers.items() if key[0] in ("k", "v")]
    gathered_blocks = [] if load_native_prefill_bf16() is not None else [case.num_kv_heads * 4 * case.block_size
                                                                          * case.head_dim] * 2
    assert [buffer.numel() for buffer in gathered] == gathered_blocks
    # The decodes' rows are those of a step of the same decodes alone, bit for bit.
    rows = [0, 22, 23, 24, 25]
    decodes = replace(batch, q=batch.q[rows], query_start_loc=torch.arange(6, dtype=torch.int32),
                      seq_lens=torch.tensor([30, 18, 19, 20, 90], dtype=torch.int32),
                      block_table=batch.block_table[[0, 3, 3, 3, 4]])
    alone = torch_backend()
    assert torch.equal(mixed[rows], alone.attend(decodes.q, decodes.k_cache, decodes.v_cache,
                                                 alone.plan(metadata_of(decodes)), decodes.scale))
    # The prompts' rows are torch's SDPA over their gathered blocks, as the torch path computes them.
    torch_only = torch_backend(native=False)
    expected = torch_only.attend(batch.q, batch.k_cache, batch.v_cache, torch_only.plan(metadata_of(batch)),
                                 batch.scale)
    assert torch.equal(mixed[1:22], expected[1:22])
    torch.testing.assert_close(mixed.float(), unified_attention_ref(*batch.args()).float(),
                               atol=TOLERANCE[torch.bfloat16], rtol=0)


def _bf16_flash_reference(batch: PagedBatch) -> torch.Tensor:
    """Decode attention as torch's bf16 flash attention rounds it, in float64: the softmax weights exp(s - max)
    rounded to bf16 before they weigh V, normalized by their unrounded sum after, the output rounded to bf16."""
    num_kv_heads, head_dim = batch.k_cache.shape[2:]
    block_size = batch.k_cache.shape[1]
    out = torch.empty(batch.q.shape, dtype=torch.float64)
    for seq, length in enumerate(batch.seq_lens.tolist()):
        slots = [int(batch.block_table[seq, t // block_size]) * block_size + t % block_size for t in range(length)]
        keys = batch.k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
        values = batch.v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
        q = batch.q[int(batch.query_start_loc[seq])].double().view(num_kv_heads, -1, head_dim)
        scores = torch.einsum("hgd,thd->hgt", q, keys) * batch.scale
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        rounded = weights.float().to(torch.bfloat16).double()
        attended = torch.einsum("hgt,thd->hgd", rounded, values) / weights.sum(-1, keepdim=True)
        out[int(batch.query_start_loc[seq])] = attended.reshape(-1, head_dim)
    return out.to(torch.bfloat16).float()


@pytest.mark.parametrize("bad", ["block id past the cache", "negative block id", "context past the row"])
def test_a_table_it_would_read_outside_the_cache_with_is_refused(routine: native_decode.NativeDecode,
                                                                 bad: str) -> None:
    q = torch.zeros(1, 4, 64)
    cache = torch.zeros(2, 3, 16, 64)  # head-major: 2 KV heads, 3 blocks
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    seq_len = 20
    if bad == "block id past the cache":
        table[0, 1] = 3
    elif bad == "negative block id":
        table[0, 0] = -1
    else:
        seq_len = 33
    metadata = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
                                 table, torch.zeros(1, dtype=torch.int64), 1, seq_len)
    with pytest.raises(ValueError, match="block table holds ids outside|runs past the end"):
        layout = plan_cpu_attention(metadata).plan.layout(16, torch.float32, True)
        routine(q, cache, cache, layout.native_decodes, 0.125, torch.empty_like(q), torch.empty(1, 4))


@pytest.mark.parametrize("cache_dtype, rows_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_queries_of_another_width_than_the_cache_takes_are_refused(routine: native_decode.NativeDecode,
                                                                   cache_dtype: torch.dtype,
                                                                   rows_dtype: torch.dtype) -> None:
    """A bf16 cache's routine reads bf16 queries and writes bf16 outputs, the others float32 ones: C would read
    and write the wrong number of bytes for the other kind."""
    q = torch.zeros(1, 4, 64, dtype=rows_dtype)
    cache = torch.zeros(2, 3, 16, 64, dtype=cache_dtype)  # head-major: 2 KV heads, 3 blocks
    metadata = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                                 torch.tensor([[0, 1]], dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 1, 20)
    layout = plan_cpu_attention(metadata).plan.layout(16, torch.float32, True)
    with pytest.raises(ValueError, match="queries and outputs"):
        routine(q, cache, cache, layout.native_decodes, 0.125, torch.empty_like(q), torch.empty(1, 4))


def test_a_slot_past_the_cache_is_refused_before_anything_past_it_is_written(routine: native_decode.NativeDecode) -> None:
    cache = torch.zeros(2, 3, 16, 8)  # head-major: 2 KV heads, 3 blocks of 16 slots
    rows = torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping holds slot 48, outside the cache's 48 slots"):
        routine.write_kv(rows, rows, cache, cache.clone(), torch.tensor([5, 48, 6]))
    assert cache[:, 0, 5].eq(1).all() and cache[:, 0, 6].eq(0).all()


@pytest.mark.parametrize("rows, slots", [
    (torch.ones(3, 2, 16), torch.tensor([0, 1, 2])),  # head_dim 16 against a cache of 8
    (torch.ones(3, 4, 8), torch.tensor([0, 1, 2])),  # 4 KV heads against 2
    (torch.ones(3, 2, 8), torch.tensor([0, 1, 2, 3])),  # more slots than rows
    (torch.ones(3, 2, 8, dtype=torch.bfloat16), torch.tensor([0, 1, 2])),  # bf16 rows into a float32 cache
], ids=["head-dim", "heads", "slots", "dtype"])
def test_rows_that_do_not_match_the_cache_are_refused(routine: native_decode.NativeDecode, rows: torch.Tensor,
                                                       slots: torch.Tensor) -> None:
    cache = torch.zeros(2, 3, 16, 8)
    with pytest.raises(ValueError, match="do not match caches"):
        routine.write_kv(rows, rows, cache, cache.clone(), slots)
    assert cache.eq(0).all()


def test_bf16_rows_are_copied_into_bf16_caches_as_the_torch_write_does(routine: native_decode.NativeDecode,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """From a fused q|k|v output (rows strided past their heads), a padded token skipped."""
    written = []
    monkeypatch.setattr(routine, "write_kv", lambda *args: written.append(native_decode.NativeDecode.write_kv(
        routine, *args)))
    generator = torch.Generator().manual_seed(3)
    kv_heads, head_dim, num_blocks, block_size = 2, 64, 6, 16
    qkv = torch.randn(5, (4 + 2 * kv_heads) * head_dim, generator=generator).bfloat16()
    key = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(5, kv_heads, head_dim)
    value = qkv[:, (4 + kv_heads) * head_dim :].view(5, kv_heads, head_dim)
    slots = torch.tensor([3, 17, -1, 95, 40])
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [new_cpu_cache(shape, torch.bfloat16, torch.device("cpu")) for _ in range(4)]
    CpuPagedAttention(routine).write_kv(key, value, caches[0], caches[1], slots)
    write_kv_cpu(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert written and caches[0].view(-1, kv_heads, head_dim)[95].equal(key[3])


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_a_cache_directory_it_cannot_create_falls_back_to_torch(
    fresh_load: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(native_decode.CACHE_ENV, str(blocker / "native"))
    with caplog.at_level(logging.WARNING, logger=native_decode.__name__):
        assert load_native_decode() is None
    assert "plain-torch path" in caplog.text


def test_queries_in_any_memory_layout_get_a_contiguous_answer(routine: native_decode.NativeDecode) -> None:
    """A head-major query tensor (dense, but not row-major) must not make the routine write rows in the wrong
    order: it reads a contiguous copy and writes a contiguous output."""
    case = CASES["mixed-gqa4-d64-b16-bf16"]
    case = replace(case, dtype=torch.float32)
    batch = make_batch(case, seed=11)
    batch = replace(batch, k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache),
                    q=batch.q.transpose(0, 1).contiguous().transpose(0, 1))
    assert not batch.q.is_contiguous()
    backend = torch_backend()
    actual = backend.attend(batch.q, batch.k_cache, batch.v_cache, backend.plan(metadata_of(batch)), batch.scale)
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=1e-5, rtol=0)
