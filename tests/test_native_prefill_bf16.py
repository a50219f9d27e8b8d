"""The compiled bf16 prefill attention on AMX tiles against a float32 reference, through the production backend.

The routine cannot equal torch's bf16 SDPA bit for bit (other summation order in its products), so it is held
to a float32 reference on the same bf16 inputs, within what bf16 allows: every output within MAX_ERROR (a few
bf16 steps at the outputs' size, about 3), and on average no further from the reference than SDPA's own bf16
result is, plus MEAN_SLACK. It computes its probabilities, and sums them, as torch's bf16 SDPA does (see
sdpa_softmax_bf16.h), so it also equals SDPA's result at all but a few outputs (MAX_SDPA_MISMATCH): that is what
keeps bf16 greedy tokens on transformers' near-tied tiny checkpoints (tests/test_bf16_accuracy.py). Shapes: GQA
1/4/7/8, head sizes 64 and 128, blocks 16 and 32, ragged batches, chunks after cached context, mixed with
decodes, contexts past one 512-key block, item rows that are not whole tiles.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backends import torch_backend
from pagedllm.attention.cpu_attention import CpuPagedAttention
from pagedllm.attention.native_decode import SWITCH_ENV, load_native_decode
from pagedllm.attention.native_prefill_bf16 import load_native_prefill_bf16
from pagedllm.kernels import unified_attention_ref

from test_cpu_attention import Case, head_major, make_batch, metadata_of

MAX_ERROR = 3e-2
MEAN_SLACK = 2e-4
MAX_SDPA_MISMATCH = 1e-3  # share of outputs that may differ from torch's bf16 SDPA (other summation order)

CASES = {
    # Qwen2.5-0.5B's heads (GQA 7, d64): one whole prompt over several key tiles, and a ragged batch of prompts
    "prompt-gqa7-d64-b16": Case((300,), (300,), 14, 2, 64, 16, torch.bfloat16),
    "ragged-gqa7-d64-b16": Case((21, 5, 130, 64), (21, 5, 130, 64), 14, 2, 64, 16, torch.bfloat16),
    # chunks after cached context (the prefix cache, chunked prefill), beside decodes
    "chunked-gqa4-d64-b16": Case((40, 1, 17, 1), (200, 77, 81, 300), 8, 2, 64, 16, torch.bfloat16),
    # head_dim 128, block 32, GQA 8: a query tile of 16 tokens, contexts ending mid-block
    "mixed-gqa8-d128-b32": Case((9, 1, 70, 2), (9, 45, 333, 2), 8, 1, 128, 32, torch.bfloat16),
    # past one 512-key softmax block: a long prompt, and a chunk after long context (the running max rescales)
    "long-gqa7-d64-b16": Case((600, 64), (600, 764), 14, 2, 64, 16, torch.bfloat16),
    # one query head per KV head: 128-token query tiles
    "prompt-gqa1-d64-b32": Case((150, 33), (150, 100), 4, 4, 64, 32, torch.bfloat16),
}


@pytest.fixture
def amx() -> None:
    if load_native_prefill_bf16() is None:
        pytest.skip("no AMX-BF16 on this CPU (or no C compiler): bf16 prefills run SDPA")


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    error = (actual.float() - expected).abs()
    return float(error.max()), float(error.mean())


@pytest.mark.parametrize("sharpness", [1.0, 6.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bf16_prefill_matches_a_float32_reference(amx: None, case: Case, sharpness: float) -> None:
    batch = make_batch(case, seed=11)
    # Peaked: larger scores, so that the running max changes between key tiles and the rescaling matters.
    q = (batch.q.float() * sharpness).to(torch.bfloat16)
    k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
    backend = torch_backend()
    planned = backend.plan(metadata_of(batch))
    layout = planned.plan.layout(case.block_size, torch.bfloat16, True, True, True)
    assert layout.native_prefills is not None and not layout.prefills  # the routine, not SDPA, takes the chunks
    actual = backend.attend(q, k_cache, v_cache, planned, batch.scale)
    expected = unified_attention_ref(q.float(), batch.k_cache.float(), batch.v_cache.float(), batch.query_start_loc,
                                     batch.seq_lens, batch.block_table, batch.scale)
    # The same step without the routine: its decodes in the compiled decode routine, its chunks in SDPA.
    sdpa = CpuPagedAttention(load_native_decode()).attend(q, k_cache, v_cache, planned, batch.scale)
    max_error, mean_error = _errors(actual, expected)
    _, sdpa_mean_error = _errors(sdpa, expected)
    assert actual.dtype == torch.bfloat16 and actual.shape == q.shape
    assert max_error <= MAX_ERROR, max_error
    assert mean_error <= sdpa_mean_error + MEAN_SLACK, (mean_error, sdpa_mean_error)
    assert float((actual != sdpa).float().mean()) <= MAX_SDPA_MISMATCH


def test_queries_read_from_fused_rows_are_read_right(amx: None) -> None:
    """q as the model passes it: a strided view of the fused q|k|v projection, not a contiguous copy."""
    case = CASES["chunked-gqa4-d64-b16"]
    batch = make_batch(case, seed=2)
    fused = torch.cat([batch.q.flatten(1), torch.randn(batch.q.shape[0], 64).to(torch.bfloat16)], dim=1)
    q = fused[:, : batch.q[0].numel()].view(batch.q.shape)
    assert not q.is_contiguous()
    k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
    backend = torch_backend()
    actual = backend.attend(q, k_cache, v_cache, backend.plan(metadata_of(batch)), batch.scale)
    expected = backend.attend(batch.q, k_cache, v_cache, backend.plan(metadata_of(batch)), batch.scale)
    assert torch.equal(actual, expected)


def test_bad_block_ids_are_refused_before_c_reads_them(amx: None) -> None:
    case = CASES["ragged-gqa7-d64-b16"]
    batch = make_batch(case)
    k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
    table = batch.block_table.clone()
    table[2, 0] = k_cache.shape[0]
    metadata = metadata_of(batch)
    backend = torch_backend()
    planned = backend.plan(type(metadata)(metadata.query_start_loc, metadata.seq_lens, table, metadata.slot_mapping,
                                          metadata.max_query_len, metadata.max_seq_len))
    with pytest.raises(ValueError, match="outside"):
        backend.attend(batch.q, k_cache, v_cache, planned, batch.scale)


def test_shapes_the_tiles_do_not_take_stay_on_sdpa() -> None:
    """A head size that is not whole 32-wide tile rows gathers its blocks for SDPA, as before."""
    case = Case((20, 1), (20, 50), 4, 2, 48, 16, torch.bfloat16)
    batch = make_batch(case, seed=4)
    backend = torch_backend()
    planned = backend.plan(metadata_of(batch))
    actual = backend.attend(batch.q, head_major(batch.k_cache), head_major(batch.v_cache), planned, batch.scale)
    assert [p.query_len for p in planned.plan.layout(16, torch.bfloat16, True).prefills] == [20]
    expected = unified_attention_ref(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(),
                                     batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale)
    assert _errors(actual, expected)[0] <= MAX_ERROR


def test_switched_off_it_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SWITCH_ENV, "0")
    load_native_prefill_bf16.cache_clear()
    try:
        assert load_native_prefill_bf16() is None
    finally:
        monkeypatch.delenv(SWITCH_ENV)
        load_native_prefill_bf16.cache_clear()


def test_threads_split_the_work_without_changing_a_bit(amx: None) -> None:
    """Items are whole (sequence, KV head, query tile)s, each on one thread with its own tile state."""
    case = CASES["chunked-gqa4-d64-b16"]
    batch = make_batch(case, seed=5)
    k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
    backend = torch_backend()
    planned = backend.plan(metadata_of(batch))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.attend(batch.q, k_cache, v_cache, planned, batch.scale)
        torch.set_num_threads(2)
        two = backend.attend(batch.q, k_cache, v_cache, planned, batch.scale)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)
