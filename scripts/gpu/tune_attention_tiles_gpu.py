"""Tune the attention tile table on this GPU: time candidate (tile, warps, stages) per 16-bit family, print the table.

For each family (decode or prefill, padded head size) every candidate is
installed in ``HOPPER_TILES`` in-process, checked against the reference once,
and timed with ``triton.testing.do_bench`` on the family's shapes (Llama-3.1-8B
heads: 32 query / 8 KV; decode batch 8 and 64 at 4k context, prefill one 2k
chunk and a mixed batch). The score is the geometric mean of the shapes' times.
Candidates that fail to compile (shared memory) or to match are skipped. The
fp32 entries are left as they are (bf16 is what runs on the GPU).

Prints the winners as ``TileConfig`` lines to paste into backend/kernels/attention_tiles.py,
then check the ratios with ``pagedllm bench kernels --rep-ms 30``.
Usage: python3 scripts/gpu/tune_attention_tiles_gpu.py [--heads 64,128,256] [--json OUT]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton.testing

from pagedllm.kernels import unified_attention, unified_attention_ref
from pagedllm.kernels import attention_tiles
from pagedllm.kernels.attention_tiles import TileConfig, TileFamily
from pagedllm.testing.paged_batch import PagedBatch, random_paged_batch

CANDIDATES = {
    "decode": [TileConfig(16, n, w, s) for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))],
    "prefill": [TileConfig(m, n, w, s) for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))],
}
SHAPES = {  # (query lens, seq lens)
    "decode": [([1] * 8, [4096] * 8), ([1] * 64, [4096] * 64)],
    "prefill": [([2048], [2048]), ([1] * 16 + [512], [2048] * 16 + [1024])],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="128", help="padded head sizes to tune (64, 128, 256)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tuning the tile table needs a CUDA GPU")
    generator = torch.Generator(device="cuda").manual_seed(0)
    results, lines = {}, []
    for phase, head in itertools.product(("decode", "prefill"), (int(h) for h in args.heads.split(","))):
        family = TileFamily(phase, head, "16bit")
        batches = [random_paged_batch(q, s, 32, 8, head, 16, torch.bfloat16, "cuda", generator)
                   for q, s in SHAPES[phase]]
        timings = tune_family(family, batches, lambda fn: triton.testing.do_bench(fn, rep=30))
        if not timings:
            print(f"{family}: no candidate compiled and matched")
            continue
        current = next((t for t in timings if t.config == attention_tiles.HOPPER_TILES[family]), None)
        best = timings[0]
        print(f"{family}: best {best.config}, {[f'{m:.3f}' for m in best.ms]} ms"
              + (f", {current.score / best.score:.2f}x faster than the current entry" if current else ""))
        results[f"{phase}-{head}"] = {"best": repr(best.config), "best_ms": best.ms,
                                      "current_ms": None if current is None else current.ms}
        c = best.config
        lines.append(f'TileFamily({phase[0]}, {head}, "16bit"): TileConfig(block_m={c.block_m}, tile_n={c.tile_n}, '
                     f"num_warps={c.num_warps}, num_stages={c.num_stages}),")
    print("\nmeasured entries for backend/kernels/attention_tiles.py:\n" + "\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


@dataclass(frozen=True, slots=True)
class Timing:
    score: float  # geometric mean of ms over the family's shapes
    config: TileConfig
    ms: list[float]


def tune_family(family: TileFamily, batches: list[PagedBatch],
                bench: Callable[[Callable[[], object]], float]) -> list[Timing]:
    """Every candidate that compiles and matches the reference, fastest first; the table entry is restored after."""
    expected = [unified_attention_ref(*b.args()).float() for b in batches]
    original = attention_tiles.HOPPER_TILES[family]
    timings = []
    try:
        for candidate in CANDIDATES[family.phase]:
            attention_tiles.HOPPER_TILES[family] = candidate
            try:
                if not all(torch.allclose(unified_attention(*b.args()).float(), e, atol=2e-2, rtol=2e-2)
                           for b, e in zip(batches, expected)):
                    print(f"{family} {candidate}: wrong result, skipped")
                    continue
                ms = [bench(lambda b=b: unified_attention(*b.args())) for b in batches]
            except Exception as error:  # noqa: BLE001 - a candidate that does not compile is skipped, with why
                print(f"{family} {candidate}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
                continue
            timings.append(Timing(math.exp(sum(map(math.log, ms)) / len(ms)), candidate, ms))
    finally:
        attention_tiles.HOPPER_TILES[family] = original
    return sorted(timings, key=lambda t: t.score)


if __name__ == "__main__":
    main()
