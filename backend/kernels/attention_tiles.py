"""The attention kernel's tile table: tile, warp and stage settings per shape family, as data.

A launch belongs to one family: its phase (``decode``: every sequence has one
new token; ``prefill``: any batch with a longer chunk, mixed batches included),
its padded head size (64 and below, 128, 256) and its q precision (16-bit, or
fp32 whose exact dot products run without tensor cores). The launcher reads the
entry of its family on every new step plan (``attention_heuristics.plan_attention``),
so a tuner can swap entries in-process.

STARTING TABLE, NOT YET MEASURED ON HOPPER. The tiles and warps are the values
the kernel ran with on the H200 (correct there, slower than SDPA; measured: RESULTS.md,
"Figures behind the code's choices"); the stage counts are the usual Hopper software-pipelining
depths (3 where the K/V tiles are small enough to triple-buffer in shared memory,
2 for the 256-wide heads). Tune on the device, then paste the printed table here:

    python3 scripts/gpu/tune_attention_tiles_gpu.py          # sweeps every family, prints HOPPER_TILES
    pagedllm bench kernels --rep-ms 30                       # the SDPA ratios with the new table

The CPU interpreter ignores warps and stages, so ``tests/test_attention_tiles.py``
checks every entry's correctness, never its speed.
"""
from __future__ import annotations

from dataclasses import dataclass

PHASES = ("decode", "prefill")
HEAD_BUCKETS = (64, 128, 256)  # a padded head size runs in the smallest bucket that holds it
PRECISIONS = ("16bit", "fp32")


@dataclass(frozen=True, slots=True)
class TileFamily:
    phase: str  # one of PHASES
    head_bucket: int  # one of HEAD_BUCKETS
    precision: str  # one of PRECISIONS


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Compile-time settings of one family's launches."""

    block_m: int  # query rows per program (query positions x packed heads), before GQA widening
    tile_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int  # software-pipelining depth of the key loop (ignored by the interpreter)


def _family_table() -> dict[TileFamily, TileConfig]:
    d, p = "decode", "prefill"
    return {
        TileFamily(d, 64, "16bit"): TileConfig(block_m=16, tile_n=64, num_warps=4, num_stages=3),
        TileFamily(d, 128, "16bit"): TileConfig(block_m=16, tile_n=64, num_warps=4, num_stages=3),
        TileFamily(d, 256, "16bit"): TileConfig(block_m=16, tile_n=32, num_warps=4, num_stages=2),
        TileFamily(d, 64, "fp32"): TileConfig(block_m=16, tile_n=32, num_warps=4, num_stages=2),
        TileFamily(d, 128, "fp32"): TileConfig(block_m=16, tile_n=32, num_warps=4, num_stages=2),
        TileFamily(d, 256, "fp32"): TileConfig(block_m=16, tile_n=32, num_warps=4, num_stages=1),
        TileFamily(p, 64, "16bit"): TileConfig(block_m=64, tile_n=64, num_warps=4, num_stages=3),
        TileFamily(p, 128, "16bit"): TileConfig(block_m=64, tile_n=64, num_warps=4, num_stages=3),
        TileFamily(p, 256, "16bit"): TileConfig(block_m=64, tile_n=32, num_warps=8, num_stages=2),
        TileFamily(p, 64, "fp32"): TileConfig(block_m=32, tile_n=32, num_warps=4, num_stages=2),
        TileFamily(p, 128, "fp32"): TileConfig(block_m=32, tile_n=32, num_warps=4, num_stages=2),
        TileFamily(p, 256, "fp32"): TileConfig(block_m=32, tile_n=32, num_warps=4, num_stages=1),
    }


# Every family has an entry; other GPUs use this table too until they get their own.
HOPPER_TILES: dict[TileFamily, TileConfig] = _family_table()


def tile_family(is_decode_only: bool, head_pad: int, element_size: int) -> TileFamily:
    """The family of a launch: ``head_pad`` is the power-of-two padded head size, ``element_size`` q's bytes."""
    bucket = next((b for b in HEAD_BUCKETS if head_pad <= b), None)
    if bucket is None:
        raise ValueError(f"head_pad {head_pad} exceeds the largest tile bucket {HEAD_BUCKETS[-1]}")
    return TileFamily("decode" if is_decode_only else "prefill", bucket, "fp32" if element_size >= 4 else "16bit")


def tile_config(family: TileFamily) -> TileConfig:
    return HOPPER_TILES[family]
