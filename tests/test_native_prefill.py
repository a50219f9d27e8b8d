"""The compiled paged prefill routine against the reference oracle: forced onto every prefill chunk (the
crossover rule aside), in mixed batches, after cached context, GQA, blocks 16 and 32, odd lengths, float32
and 8-bit caches; and how the plan splits chunks between it and SDPA."""
from __future__ import annotations

import logging
from dataclasses import replace
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.kernels import unified_attention_ref
from pagedllm.kernels.reference import FP8_DTYPES, quantize_kv_ref
from pagedllm.attention import cpu_attention_plan, native_decode
from pagedllm.attention.backends import torch_backend
from pagedllm.attention.cpu_attention_plan import NativePrefills, native_prefill_wins
from pagedllm.attention.native_prefill import load_native_prefill

from test_cpu_attention import Case, head_major, make_batch, metadata_of

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")

CASES = {
    # whole prompts and chunks after cached context, odd lengths, one KV head per query head
    "prefill-gqa1-d64-b16": Case((21, 5, 7, 33), (21, 5, 40, 97), 4, 4, 64, 16),
    # mixed with decodes; a chunk of one full key tile plus one row, GQA 4
    "mixed-gqa4-d64-b16": Case((1, 65, 3, 1, 130), (300, 65, 200, 17, 1000), 8, 2, 64, 16),
    # block 32, head_dim 128, GQA 8: more rows per token than a query tile's 64 / 8 tokens
    "mixed-gqa8-d128-b32": Case((9, 1, 70, 2), (9, 45, 333, 2), 8, 1, 128, 32),
    # a head size the routine does not special-case, GQA 2, block 32
    "chunked-gqa2-d48-b32": Case((17, 100, 1), (50, 131, 64), 4, 2, 48, 32),
    # block 16 with a query tile (64 rows) that is not a whole number of tokens (GQA 3)
    "chunked-gqa3-d80-b16": Case((23, 5), (88, 5), 6, 2, 80, 16),
}


def in_row_order(prefills: NativePrefills) -> list[tuple[int, int]]:
    """The chunks' (query_len, seq_len) in the batch's order (the routine takes them grouped by prefix)."""
    chunks = zip(prefills.starts.tolist(), prefills.query_lens.tolist(), prefills.seq_lens.tolist())
    return [(query_len, seq_len) for _, query_len, seq_len in sorted(chunks)]


@pytest.fixture
def always_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk goes to the compiled routine, whatever the crossover rule says."""
    if load_native_prefill() is None:
        pytest.skip("no C compiler: the compiled prefill routine is not built")
    monkeypatch.setattr(cpu_attention_plan, "native_prefill_wins", lambda query_len, seq_len, wide=False: True)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_compiled_prefill_matches_the_reference(always_compiled: None, case: Case) -> None:
    batch = make_batch(case, seed=7)
    k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
    backend = torch_backend()
    planned = backend.plan(metadata_of(batch))
    layout = planned.plan.layout(case.block_size, case.dtype, True, True)
    assert not layout.prefills and layout.native_prefills is not None
    # A few new tokens after earlier context run as decodes (cpu_attention_plan.MAX_CHUNK_AS_DECODES).
    chunks = [n for n, seq_len in zip(case.query_lens, case.seq_lens)
              if n > cpu_attention_plan.MAX_CHUNK_AS_DECODES or 1 < n == seq_len]
    assert [query_len for query_len, _ in in_row_order(layout.native_prefills)] == chunks
    actual = backend.attend(batch.q, k_cache, v_cache, planned, batch.scale)
    expected = unified_attention_ref(*batch.args())
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_chunks_behind_the_same_prefix_are_taken_one_after_another(always_compiled: None) -> None:
    """Chunks after two cached prefixes, arrived interleaved (A B A B): the routine takes each prefix's chunks
    together, and every chunk's rows are still its own."""
    case = Case((20, 21, 22, 23), (100, 101, 102, 103), 4, 2, 64, 16)
    batch = make_batch(case, seed=11)
    table = batch.block_table.clone()
    table[2, :4] = table[0, :4]
    table[3, :4] = table[1, :4]
    k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
    backend = torch_backend()
    planned = backend.plan(metadata_of(replace(batch, block_table=table)))
    prefills = planned.plan.layout(16, torch.float32, True, True).native_prefills
    assert prefills is not None
    firsts = prefills.block_table[:, 0].tolist()
    assert firsts[0] == firsts[1] and firsts[2] == firsts[3] and firsts[0] != firsts[2]
    assert in_row_order(prefills) == list(zip(case.query_lens, case.seq_lens))
    actual = backend.attend(batch.q, k_cache, v_cache, planned, batch.scale)
    expected = unified_attention_ref(*replace(batch, block_table=table).args())
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", [CASES["mixed-gqa4-d64-b16"], CASES["chunked-gqa2-d48-b32"]], ids=["b16", "b32"])
def test_compiled_prefill_reads_fp8_caches_like_the_reference(always_compiled: None, case: Case,
                                                               dtype: torch.dtype) -> None:
    batch = make_batch(case, seed=3)
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.007])
    k8, v8 = quantize_kv_ref(batch.k_cache, k_scale, dtype), quantize_kv_ref(batch.v_cache, v_scale, dtype)
    expected = unified_attention_ref(batch.q, k8, v8, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                     batch.scale, k_scale=k_scale, v_scale=v_scale)
    k_stored, v_stored = head_major(k8), head_major(v8)
    backend = torch_backend()
    actual = backend.attend(batch.q, k_stored, v_stored, backend.plan(metadata_of(batch)), batch.scale, k_scale,
                            v_scale)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_a_query_with_strided_heads_is_read_right(always_compiled: None) -> None:
    """Queries sliced out of a fused projection (not contiguous) are made contiguous before C reads them."""
    case = CASES["mixed-gqa4-d64-b16"]
    batch = make_batch(case, seed=1)
    fused = torch.cat([batch.q, torch.randn_like(batch.q)], dim=2)
    q = fused[:, :, : case.head_dim]
    backend = torch_backend()
    actual = backend.attend(q, head_major(batch.k_cache), head_major(batch.v_cache), backend.plan(metadata_of(batch)),
                            batch.scale)
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=1e-5, rtol=0)


def test_the_plan_splits_chunks_by_the_crossover_rule() -> None:
    """Short chunks go to the compiled routine, long ones stay on SDPA, decodes are not prefills."""
    case = Case((1, 32, 1024, 5), (100, 500, 1024, 5), 8, 2, 64, 16)
    plan = torch_backend().plan(metadata_of(make_batch(case))).plan
    layout = plan.layout(16, torch.float32, True, True)
    native = [(q, s) for q, s in zip(case.query_lens, case.seq_lens) if q > 1 and native_prefill_wins(q, s)]
    assert native == [(32, 500), (5, 5)] and not native_prefill_wins(1024, 1024)
    assert layout.native_prefills is not None
    assert in_row_order(layout.native_prefills) == native
    assert [(p.query_len, p.seq_len) for p in layout.prefills] == [(1024, 1024)]
    # Without the compiled routine every chunk is SDPA's.
    assert len(plan.layout(16, torch.float32, True, False).prefills) == 3


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
def test_mixed_prefill_and_decode_batch_matches_the_reference_with_the_real_rule(native: bool) -> None:
    case = Case((1, 32, 300, 5, 1), (100, 500, 300, 9, 31), 8, 2, 64, 16)
    batch = make_batch(case, seed=5)
    backend = torch_backend(native=native)
    actual = backend.attend(batch.q, head_major(batch.k_cache), head_major(batch.v_cache),
                            backend.plan(metadata_of(batch)), batch.scale)
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=1e-5, rtol=0)


def test_bad_block_ids_are_refused_before_c_reads_them(always_compiled: None) -> None:
    case = CASES["prefill-gqa1-d64-b16"]
    batch = make_batch(case)
    k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
    table = batch.block_table.clone()
    table[0, 0] = k_cache.shape[0]
    metadata = metadata_of(batch)
    backend = torch_backend()
    planned = backend.plan(type(metadata)(metadata.query_start_loc, metadata.seq_lens, table, metadata.slot_mapping,
                                          metadata.max_query_len, metadata.max_seq_len))
    with pytest.raises(ValueError, match="outside"):
        backend.attend(batch.q, k_cache, v_cache, planned, batch.scale)


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv(native_decode.CACHE_ENV, str(tmp_path))
    load_native_prefill.cache_clear()
    yield
    load_native_prefill.cache_clear()


def test_switched_off_it_is_never_built_and_torch_runs(fresh_load: None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_decode.SWITCH_ENV, "0")
    assert load_native_prefill() is None
    assert not list(tmp_path.iterdir())


@needs_compiler
def test_it_builds_once_into_the_native_cache(fresh_load: None, tmp_path: Path) -> None:
    assert load_native_prefill() is not None
    assert len(list(tmp_path.glob("paged_prefill-*.so"))) == 1


def test_without_a_compiler_it_says_why(fresh_load: None, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING):
        assert load_native_prefill() is None
    assert "plain-torch path" in caplog.text


def test_a_wide_build_takes_every_chunk() -> None:
    """Built with 16-lane vectors the routine beat SDPA on every chunk measured, so the plan sends it all."""
    case = Case((1, 32, 1024, 5), (100, 500, 1024, 5), 8, 2, 64, 16)
    plan = torch_backend().plan(metadata_of(make_batch(case))).plan
    layout = plan.layout(16, torch.float32, True, True, wide_prefill=True)
    assert not layout.prefills and layout.native_prefills is not None
    assert [query_len for query_len, _ in in_row_order(layout.native_prefills)] == [32, 1024, 5]
    assert native_prefill_wins(2048, 4096, wide=True) and not native_prefill_wins(2048, 4096)


def test_the_build_says_how_wide_it_computes() -> None:
    native = load_native_prefill()
    if native is None:
        pytest.skip("no C compiler: the compiled prefill routine is not built")
    cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert native.wide == bool(re.search(r"\bavx512f\b", cpu_flags))


def test_the_rule_is_monotone_in_query_length() -> None:
    """Once SDPA wins for a context, it keeps winning for longer chunks over it."""
    for context in (0, 128, 512, 2048):
        wins = [native_prefill_wins(q, context + q) for q in range(2, 2048, 7)]
        assert wins == sorted(wins, reverse=True)
    assert np.all([native_prefill_wins(q, q) for q in (2, 16, 64)])
