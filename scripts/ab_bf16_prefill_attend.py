"""bf16 prefill attention: the AMX routine against gather + torch's bf16 SDPA, one layer's call, in one process.

    OMP_NUM_THREADS=1 python -P scripts/ab_bf16_prefill_attend.py --rounds 7

Both sides are ``CpuPagedAttention.attend`` on the same planned step and head-major bf16 cache: A with the
compiled decode routine only (bf16 prefill chunks gather their blocks and run SDPA, as before the routine),
B with the AMX routine as well. Calls alternate, A and B in turns with the order swapped every round; each
round times ``--calls`` calls of each and the table gives the per-call median over rounds, the B/A speed-up,
and how many outputs differ between the two (the routine computes SDPA's softmax, so almost none should).
Shapes: Qwen2.5-0.5B's heads (14 query, 2 KV, 64) and Qwen2.5-1.5B's (12, 2, 128), whole prompts and a chunk
after cached context, blocks of 16.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pagedllm.attention.backends import torch_backend  # noqa: E402
from pagedllm.attention.cpu_attention import CpuPagedAttention  # noqa: E402
from pagedllm.attention.native_decode import load_native_decode  # noqa: E402
from pagedllm.attention.native_prefill_bf16 import load_native_prefill_bf16  # noqa: E402
from test_cpu_attention import Case, head_major, make_batch, metadata_of  # noqa: E402

SHAPES = {
    "0.5B 1 x 512": Case((512,), (512,), 14, 2, 64, 16, torch.bfloat16),
    "0.5B 4 x 256": Case((256,) * 4, (256,) * 4, 14, 2, 64, 16, torch.bfloat16),
    "0.5B 8 x 256": Case((256,) * 8, (256,) * 8, 14, 2, 64, 16, torch.bfloat16),
    "0.5B 32 x 64": Case((64,) * 32, (64,) * 32, 14, 2, 64, 16, torch.bfloat16),
    "0.5B 128 after 472": Case((128,), (600,), 14, 2, 64, 16, torch.bfloat16),
    "0.5B 1 x 1024": Case((1024,), (1024,), 14, 2, 64, 16, torch.bfloat16),
    "1.5B 1 x 512": Case((512,), (512,), 12, 2, 128, 16, torch.bfloat16),
}


def _timed(call: object, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()  # type: ignore[operator]
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    if load_native_prefill_bf16() is None:
        raise SystemExit("the AMX routine does not run on this machine")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} thread(s)")
    print("| shape | A: gather + SDPA ms | B: AMX routine ms | B / A speed | outputs differing |")
    print("|---|---|---|---|---|")
    for name, case in SHAPES.items():
        batch = make_batch(case, seed=1)
        k_cache, v_cache = head_major(batch.k_cache), head_major(batch.v_cache)
        backend = torch_backend()
        planned = backend.plan(metadata_of(batch))
        sdpa = CpuPagedAttention(load_native_decode())
        sides = {"A": lambda: sdpa.attend(batch.q, k_cache, v_cache, planned, batch.scale),
                 "B": lambda: backend.attend(batch.q, k_cache, v_cache, planned, batch.scale)}
        differing = int((sides["A"]() != sides["B"]()).sum())
        times: dict[str, list[float]] = {"A": [], "B": []}
        for round_ in range(args.rounds):
            for side in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                times[side].append(_timed(sides[side], args.calls))
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {differing} of {batch.q.numel()} |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
