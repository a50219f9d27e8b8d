"""Every tile-table entry, split counts and GQA packing, run by the interpreter against the reference.

Each family of ``backend/kernels/attention_tiles.py`` gets one batch that lands in it
(decode-only for ``decode``, a mixed prefill + decode batch for ``prefill``),
and the test checks that the launch used that entry's settings and that its
output matches ``unified_attention_ref``. ``pytest --full``
runs every family at several GQA groups and split counts instead of one case each.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import full_run

from pagedllm.kernels import unified_attention_ref
from pagedllm.kernels.attention_launch import plan_unified_attention, unified_attention_planned
from pagedllm.kernels.attention_tiles import HOPPER_TILES, HEAD_BUCKETS, PHASES, PRECISIONS, TileFamily, tile_config
from pagedllm.testing.paged_batch import random_paged_batch

FULL_MATRIX = full_run.full()
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
HEAD_DIMS = {64: 48, 128: 96, 256: 160}  # unpadded head sizes that pad into each bucket
BLOCK_SIZE = 16


def _batch(phase: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query lens, seq lens): a decode-only batch, or a mixed one (a decode, a mid-sequence chunk, a first chunk)."""
    return ((1, 1, 1), (1, 40, 100)) if phase == "decode" else ((1, 6, 19), (70, 22, 19))


def _run(family: TileFamily, group: int, num_kv_heads: int, num_splits: int | None,
         dtype: torch.dtype, seed: int = 0) -> None:
    query_lens, seq_lens = _batch(family.phase)
    batch = random_paged_batch(query_lens, seq_lens, group * num_kv_heads, num_kv_heads, HEAD_DIMS[family.head_bucket],
                               BLOCK_SIZE, dtype, generator=torch.Generator().manual_seed(seed), spare_columns=1)
    step = plan_unified_attention(batch.query_start_loc, batch.seq_lens, batch.block_table)
    actual = unified_attention_planned(batch.q, batch.k_cache, batch.v_cache, step, batch.scale, num_splits=num_splits)
    (launch,) = step.launches.values()
    config = tile_config(family)
    tiles = launch.tiles
    assert (tiles.tile_n, tiles.num_warps, tiles.num_stages) == (config.tile_n, config.num_warps, config.num_stages)
    assert tiles.block_m == max(config.block_m, tiles.group_pad) and tiles.block_q * tiles.group_pad == tiles.block_m
    # GQA packing: one program per KV head (and query block, and split), never one per query head.
    assert launch.grid[1] == num_kv_heads and tiles.group == group
    if num_splits is not None:
        assert launch.grid[2] == num_splits and (launch.partials is None) == (num_splits == 1)
    expected = unified_attention_ref(*batch.args())
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


def _dtype(family: TileFamily) -> torch.dtype:
    return torch.float32 if family.precision == "fp32" else torch.bfloat16


ALL_FAMILIES = [TileFamily(*key) for key in itertools.product(PHASES, HEAD_BUCKETS, PRECISIONS)]


def test_the_table_has_one_valid_entry_per_family() -> None:
    assert set(HOPPER_TILES) == set(ALL_FAMILIES)
    for family, config in HOPPER_TILES.items():
        for name in ("block_m", "tile_n"):
            value = getattr(config, name)
            assert value >= 16 and value & (value - 1) == 0, f"{family}: {name}={value} is not a power of two >= 16"
        assert config.num_warps in (1, 2, 4, 8, 16) and config.num_stages >= 1, family


# The default run: every entry once, at GQA 4 with the heuristic's splits (1 in the interpreter's one "SM"),
# plus split counts (uneven, and one tile per split) and a non-power-of-two group on the 16-bit families.
DEFAULT_CASES = [(family, 4, 2, None) for family in ALL_FAMILIES] + [
    (TileFamily("decode", 128, "16bit"), 4, 2, 3),
    (TileFamily("decode", 64, "fp32"), 7, 1, 7),  # the 100-key context is 4 key tiles: 7 splits leave some empty
    (TileFamily("prefill", 128, "16bit"), 7, 1, 2),
    (TileFamily("prefill", 64, "fp32"), 8, 1, 4),
    (TileFamily("decode", 64, "16bit"), 32, 1, None),  # a group wider than the entry's 16 rows widens the tile
]
FULL_CASES = [(family, group, kv, splits) for family in ALL_FAMILIES
              for group, kv in ((1, 2), (3, 2), (8, 1)) for splits in (None, 2, 5)]


def _case_id(value: object) -> str:
    return f"{value.phase}-d{value.head_bucket}-{value.precision}" if isinstance(value, TileFamily) else str(value)


@pytest.mark.parametrize(("family", "group", "num_kv_heads", "num_splits"), FULL_CASES if FULL_MATRIX else DEFAULT_CASES,
                         ids=_case_id)
def test_table_entry_matches_the_reference(family: TileFamily, group: int, num_kv_heads: int,
                                           num_splits: int | None) -> None:
    _run(family, group, num_kv_heads, num_splits, _dtype(family))


def test_every_split_of_every_sequence_gets_keys() -> None:
    """Each sequence shares its own key tiles evenly among the splits: 6 splits of the 512-key sequence's 16
    tiles and of the 200-key one's 7 all hold keys (slices of the block table's width, 16 / 6 tiles, would leave
    the short sequence's last three splits empty, and under a CUDA graph every table is full width)."""
    batch = random_paged_batch((1, 1), (512, 200), 8, 2, 64, BLOCK_SIZE, torch.float32,
                               generator=torch.Generator().manual_seed(3))
    assert tile_config(TileFamily("decode", 64, "fp32")).tile_n == 32
    step = plan_unified_attention(batch.query_start_loc, batch.seq_lens, batch.block_table)
    actual = unified_attention_planned(batch.q, batch.k_cache, batch.v_cache, step, batch.scale, num_splits=6)
    (launch,) = step.launches.values()
    part_max = launch.partials[1]  # [tokens, heads, splits]: -inf where a split saw no key
    assert bool(torch.isfinite(part_max).all()), "a split saw no key"
    torch.testing.assert_close(actual, unified_attention_ref(*batch.args()), atol=1e-5, rtol=0)
