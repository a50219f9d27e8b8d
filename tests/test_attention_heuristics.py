"""The split-KV heuristic's choices, as properties over batch 1-256 and context 512-128k on 132 and 78 SMs.

Pure host arithmetic (no kernel runs): the interpreter tests of the same plans
are in ``test_attention_heuristics_kernels.py``.
"""
from __future__ import annotations

import itertools

import pytest

from pagedllm.kernels.attention_heuristics import MAX_SPLITS, MIN_KEYS_PER_SPLIT, num_kv_splits, plan_attention
from pagedllm.kernels.attention_tiles import HOPPER_TILES, TileConfig, TileFamily

BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 48, 64, 100, 128, 200, 256)
CONTEXTS = (512, 1024, 2048, 3000, 4096, 8192, 16384, 32768, 65536, 131072)
SMS = (132, 78)  # H100/H200, and a GPU with fewer SMs
# (query heads, KV heads, head_dim): Llama-3.1-8B (GQA 4), Llama-3.1-70B per TP=8 rank (GQA 8, 1 KV head),
# an MHA model, Qwen2.5-7B (GQA 7).
MODELS = ((32, 8, 128), (8, 1, 128), (16, 16, 64), (28, 4, 128))


def decode_plan(batch: int, context: int, sms: int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(splits, key tile) of a decode-only step of ``batch`` sequences whose block table holds ``context`` keys."""
    tiles = plan_attention(batch, batch, heads, kv_heads, head_dim, context, sms)
    return tiles.num_splits, tiles.tile_n


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
def test_split_choices_fill_the_gpu_and_no_more(sms: int, heads: int, kv_heads: int, head_dim: int) -> None:
    for batch, context in itertools.product(BATCHES, CONTEXTS):
        splits, tile_n = decode_plan(batch, context, sms, heads, kv_heads, head_dim)
        programs = batch * kv_heads  # GQA packing: one program per (sequence, KV head), not per query head
        where = f"batch {batch}, context {context}, {sms} SMs, {kv_heads} KV heads: {splits} splits"
        assert 1 <= splits <= MAX_SPLITS, where
        assert splits <= -(-context // tile_n) and splits <= context // 16, f"more splits than KV tiles/blocks: {where}"
        if splits > 1:
            assert context // splits >= MIN_KEYS_PER_SPLIT, f"a split below {MIN_KEYS_PER_SPLIT} keys: {where}"
            assert programs * (splits - 1) < sms, f"one split fewer would still fill the GPU: {where}"
        work_allows = programs * min(context // MIN_KEYS_PER_SPLIT, MAX_SPLITS) >= sms
        if work_allows:
            assert programs * splits >= sms, f"the GPU is not filled although the context allows it: {where}"
        if programs >= sms:
            assert splits == 1, f"a batch that fills the GPU alone is split: {where}"


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
def test_splits_rise_with_context_and_fall_with_batch(sms: int, heads: int, kv_heads: int, head_dim: int) -> None:
    table = {(b, c): decode_plan(b, c, sms, heads, kv_heads, head_dim)[0] for b in BATCHES for c in CONTEXTS}
    for batch in BATCHES:
        by_context = [table[batch, c] for c in CONTEXTS]
        assert by_context == sorted(by_context), f"batch {batch}: splits by context {by_context}"
    for context in CONTEXTS:
        by_batch = [table[b, context] for b in BATCHES]
        assert by_batch == sorted(by_batch, reverse=True), f"context {context}: splits by batch {by_batch}"


def test_llama_8b_choices_on_an_h200() -> None:
    """The plan spelled out for Llama-3.1-8B (8 KV heads, GQA 4) on 132 SMs: one program per SM at most batches."""
    choices = {(b, c): decode_plan(b, c, 132, 32, 8, 128)[0]
               for b in (1, 8, 16, 17, 64, 256) for c in (512, 4096, 131072)}
    assert choices == {
        (1, 512): 2, (1, 4096): 16, (1, 131072): 17,  # 8 programs: 17 splits fill 132 SMs; 512 keys allow only 2
        (8, 512): 2, (8, 4096): 3, (8, 131072): 3,  # 64 programs x 3 = 192 >= 132 (x 2 = 128 would not fill)
        (16, 512): 2, (16, 4096): 2, (16, 131072): 2,  # 128 programs: a second split fills the last 4 SMs
        (17, 512): 1, (17, 4096): 1, (17, 131072): 1,  # 136 programs fill the GPU alone
        (64, 512): 1, (64, 4096): 1, (64, 131072): 1,
        (256, 512): 1, (256, 4096): 1, (256, 131072): 1,
    }


def test_only_decode_only_batches_split() -> None:
    assert num_kv_splits(num_seqs=2, num_tokens=700, num_kv_heads=8, max_context=131072, num_sms=132) == 1
    assert num_kv_splits(num_seqs=0, num_tokens=0, num_kv_heads=8, max_context=131072, num_sms=132) == 1
    mixed = plan_attention(num_tokens=9, num_seqs=3, num_heads=32, num_kv_heads=8, head_dim=128,
                           max_context=131072, num_sms=132)
    assert mixed.num_splits == 1


def test_short_contexts_and_explicit_splits() -> None:
    assert num_kv_splits(num_seqs=1, num_tokens=1, num_kv_heads=8, max_context=MIN_KEYS_PER_SPLIT, num_sms=132) == 1
    assert num_kv_splits(num_seqs=1, num_tokens=1, num_kv_heads=8, max_context=16, num_sms=132) == 1
    assert plan_attention(1, 1, 32, 8, 128, 131072, 132, num_splits=5).num_splits == 5


def test_plans_read_the_tile_table_when_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner (scripts/gpu/tune_attention_tiles_gpu.py) swaps entries in-process; the next plan must use them."""
    family = TileFamily("decode", 128, "16bit")
    assert plan_attention(8, 8, 32, 8, 128, 4096, 132).tile_n == HOPPER_TILES[family].tile_n
    monkeypatch.setitem(HOPPER_TILES, family, TileConfig(block_m=32, tile_n=128, num_warps=8, num_stages=4))
    tiles = plan_attention(8, 8, 32, 8, 128, 4096, 132)
    assert (tiles.block_m, tiles.tile_n, tiles.num_warps, tiles.num_stages) == (32, 128, 8, 4)
    assert tiles.num_splits == 3  # 4096 keys are 32 tiles of 128: the cap of 2 tiles a split still allows 3
