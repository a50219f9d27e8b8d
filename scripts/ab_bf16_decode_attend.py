"""A bf16 decode step's attention call, ``AttentionBackend.attend``, from two versions of pagedllm side by side.

    git archive <commit> backend | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python -P scripts/ab_bf16_decode_attend.py --base /tmp/base [--batches 1,16,32]

What one layer of a bf16 decode step calls, on the engine's shapes (Qwen2.5-0.5B: 14 query and 2 KV
heads of 64, blocks of 16): the base version's from ``DIR/backend``, the working tree's, each with its own
compiled routine, on the same cache, block table and queries. Checks that both give the same bits, then
times them in interleaved rounds (a busy spell of a shared host lands on both) and prints median µs per
call and base / new.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 14, 2, 64, 16


def _import_backend(package_parent: Path | None) -> ModuleType:
    """``pagedllm.attention.backends`` from the package under ``package_parent`` (None: the working tree's)."""
    for name in [name for name in sys.modules if name == "pagedllm" or name.startswith("pagedllm.")]:
        del sys.modules[name]
    if package_parent is not None:
        sys.path.insert(0, str(package_parent))
    try:
        return importlib.import_module("pagedllm.attention.backends")
    finally:
        if package_parent is not None:
            sys.path.remove(str(package_parent))


def _attend_call(backends: ModuleType, batch: int, context: int, seed: int) -> Callable[[], torch.Tensor]:
    """One layer's attend over a step of ``batch`` bf16 decodes of ``context`` tokens each (same data per seed)."""
    metadata_module = sys.modules["pagedllm.attention.metadata"]
    cpu_attention = sys.modules["pagedllm.attention.cpu_attention"]
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (cpu_attention.new_cpu_cache(shape, torch.bfloat16, torch.device("cpu")) for _ in range(2))
    k_cache.copy_(torch.randn(shape, generator=generator).bfloat16())
    v_cache.copy_(torch.randn(shape, generator=generator).bfloat16())
    table = torch.randperm(num_blocks - 1, generator=generator)[: batch * blocks_per_seq].view(batch, -1).int()
    metadata = metadata_module.AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=torch.full((batch,), context,
                                                                                           dtype=torch.int32),
        block_table=table, slot_mapping=torch.zeros(batch, dtype=torch.int64), max_query_len=1, max_seq_len=context)
    backend = backends.torch_backend()
    planned = backend.plan(metadata)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).bfloat16()
    return lambda: backend.attend(q, k_cache, v_cache, planned, HEAD_DIM**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="a tree whose backend/ is the base version")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=50, help="calls per round")
    args = parser.parse_args()
    # The temporary package stays while the base builds its compiled routine, on its first call.
    with tempfile.TemporaryDirectory() as scratch:
        package_parent = Path(scratch)
        (package_parent / "pagedllm").symlink_to((args.base / "backend").resolve())
        base = _import_backend(package_parent)
        new = _import_backend(None)
        print(f"{torch.get_num_threads()} thread(s), context {args.context}, base {args.base}\n")
        print("| batch | base µs | new µs | base / new | same bits |\n|---|---|---|---|---|")
        for batch in (int(b) for b in args.batches.split(",")):
            _compare(base, new, batch, args.context, args.rounds, args.calls)


def _compare(base: ModuleType, new: ModuleType, batch: int, context: int, rounds: int, calls_per_round: int) -> None:
    calls = {"base": _attend_call(base, batch, context, batch), "new": _attend_call(new, batch, context, batch)}
    same = torch.equal(calls["base"]().view(torch.int16), calls["new"]().view(torch.int16))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(rounds):
        for name in ("base", "new") if round_index % 2 == 0 else ("new", "base"):
            started = time.perf_counter()
            for _ in range(calls_per_round):
                calls[name]()
            times[name].append((time.perf_counter() - started) / calls_per_round * 1e6)
    old_us, new_us = statistics.median(times["base"]), statistics.median(times["new"])
    print(f"| {batch} | {old_us:.1f} | {new_us:.1f} | {old_us / new_us:.2f} | {same} |", flush=True)

if __name__ == "__main__":
    main()
