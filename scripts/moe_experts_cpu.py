"""One sparse block's routed experts on the CPU, per call: the plain-torch reference, the compiled routine
(``pagedllm.layers.moe_cpu``), and one dense MKL-packed gate|up + down GEMM pair over as many rows.

The shapes are the tiny MoE benchmark models' (hidden 256, expert width 128) at decode-step token counts.
Times are CPU time of this thread (``time.thread_time``), best of ``--repeats`` x ``--calls`` calls, so
that other jobs on a shared host do not count; each row is measured twice, to show the spread.

    .venv/bin/python scripts/moe_experts_cpu.py
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedllm.kernels.fused_moe_reference import fused_moe_ref
from pagedllm.layers.cpu_linear import MklPackedLinear
from pagedllm.layers.moe_cpu import load_native_moe, pack_experts

HIDDEN, INTER = 256, 128
CASES = ((8, 2, 32), (16, 4, 32), (16, 4, 4), (16, 4, 1))  # (experts, top-k, tokens)


def best_ms(call: Callable[[], object], calls: int, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, (time.thread_time() - start) / calls * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    native = load_native_moe()
    if native is None:
        raise SystemExit("the compiled MoE experts could not be built here (see the warning above)")
    print("| experts, top-k, tokens | reference ms | compiled ms | dense MKL-packed pair ms |\n|---|---|---|---|")
    for experts, top_k, tokens in CASES:
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(tokens, HIDDEN, generator=generator)
        w_gate_up = torch.randn(experts, 2 * INTER, HIDDEN, generator=generator) * 0.05
        w_down = torch.randn(experts, HIDDEN, INTER, generator=generator) * 0.05
        weights, ids = torch.randn(tokens, experts, generator=generator).softmax(-1).topk(top_k)
        packed = pack_experts(w_gate_up, w_down)
        gate_up, down = MklPackedLinear(w_gate_up[0], None), MklPackedLinear(w_down[0], None)
        rows, activations = torch.randn(tokens * top_k, HIDDEN), torch.randn(tokens * top_k, INTER)
        timings = [[best_ms(call, args.calls, args.repeats) for _ in range(2)] for call in (
            lambda: fused_moe_ref(hidden, w_gate_up, w_down, weights, ids),
            lambda: native.run(hidden, packed, weights, ids),
            lambda: (gate_up(rows), down(activations)))]
        cells = " | ".join(f"{min(pair):.2f}–{max(pair):.2f}" for pair in timings)
        print(f"| {experts}, top-{top_k}, {tokens} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
