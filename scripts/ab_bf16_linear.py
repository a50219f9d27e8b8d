"""bf16 CPU linears, side by side: which GEMM this torch offers is fastest here, at decode and prefill rows.

    OMP_NUM_THREADS=1 python scripts/ab_bf16_linear.py [--rows 1,16,512] [--shapes 896x1152,...]

Candidates, each on the same bf16 weight and input, rounds interleaved (a busy spell of a shared
host hits every candidate alike), median µs per call and the weight-streaming rate it implies:

- ``F.linear``: what a bf16 ``nn.Linear`` runs (oneDNN matmul on a weight it re-lays out per call);
- ``onednn-packed``: ``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight``'s packed weight;
- ``mkl-packed-f32``: float32 MKL packed GEMM (pagedllm's float32 default) on the same weight, for scale.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_linear import MklPackedLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    # Qwen2.5-0.5B's qkv, o, gate|up, down.
    parser.add_argument("--shapes", default="896x1152,896x896,896x9728,4864x896")
    parser.add_argument("--rows", default="1,16,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); median µs per call (GB/s of weight)\n")
    print("| in×out | rows | F.linear bf16 | oneDNN packed bf16 | MKL packed f32 | max abs diff packed vs F.linear |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        weight = torch.randn(n, k) * 0.05
        w16 = weight.bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w16, None)
        mkl = MklPackedLinear(w16.float(), None)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            x32 = x.float()
            candidates = {
                "F.linear": lambda: F.linear(x, w16),
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                "mkl32": lambda: mkl(x32),
            }
            times: dict[str, list[float]] = {name: [] for name in candidates}
            for _ in range(args.rounds):
                for name, call in candidates.items():
                    call()
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    times[name].append((time.perf_counter() - started) / args.calls)
            diff = (candidates["onednn"]().float() - candidates["F.linear"]().float()).abs().max().item()
            cells = []
            for name, bytes_per in (("F.linear", 2), ("onednn", 2), ("mkl32", 4)):
                t = statistics.median(times[name])
                cells.append(f"{t * 1e6:.0f} ({n * k * bytes_per / t / 1e9:.1f})")
            print(f"| {k}×{n} | {rows} | " + " | ".join(cells) + f" | {diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
