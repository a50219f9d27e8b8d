"""float32 CPU linears, side by side: our native GEMM, MKL-packed and oneDNN-packed, a model's whole body per call.

    OMP_NUM_THREADS=1 python scripts/ab_fp32_linear.py [--models tiny,small,qwen2.5-0.5b,qwen2.5-1.5b]
        [--rows 1,4,16,64,256,2048] [--packings native,mkl,onednn]

One call runs every layer's qkv, o, gate|up and down linears (and the LM head where ``--lm-head``) on
``rows`` rows, each layer with its own weights, so a model that outgrows the caches streams its weights
as a decode step does. Every packing of the same weights, rounds interleaved (a busy spell of a shared
host hits all alike); median ms per call, and oneDNN's time over each one's (above 1: faster than oneDNN). ``--layers`` caps the distinct layers built (memory); the
figure is scaled to the model's layer count.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.layers.cpu_linear import MklPackedLinear, NativeLinear, OneDnnLinear, PackedLinear
from pagedllm.testing.tiny_model import SIZES

# hidden, layers, heads, kv heads, intermediate, vocab
REAL = {"qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936), "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936)}
KINDS: dict[str, type[PackedLinear]] = {"native": NativeLinear, "mkl": MklPackedLinear, "onednn": OneDnnLinear}


def _shape(model: str) -> tuple[int, int, int, int, int, int]:
    if model in REAL:
        return REAL[model]
    s = SIZES[model]
    return s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size, s.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,small,qwen2.5-0.5b")
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--packings", default="native,mkl,onednn", help="which of native, mkl, onednn")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lm-head", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1, help="body calls per round")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); median ms per body call (first round dropped as warm-up)\n")
    names = args.packings.split(",")
    unknown = sorted(set(names) - KINDS.keys())
    if unknown or "onednn" not in names:
        raise SystemExit(f"--packings takes {', '.join(KINDS)}, oneDNN among them; got {args.packings}")
    others = [name for name in names if name != "onednn"]
    print("| model | rows | " + " | ".join(f"{name} (ms)" for name in names) + " | "
          + " | ".join(f"oneDNN / {name}" for name in others) + " |")
    print("|---|---|" + "---|" * (len(names) + len(others)))
    for model in args.models.split(","):
        hidden, layers, heads, kv_heads, intermediate, vocab = _shape(model)
        head_dim = hidden // heads
        shapes = [(hidden, (heads + 2 * kv_heads) * head_dim), (hidden, hidden),
                  (hidden, 2 * intermediate), (intermediate, hidden)]
        built = min(layers, args.layers)
        if args.lm_head and built < layers:
            raise SystemExit(f"--lm-head needs all {layers} layers of {model} built (--layers {layers})")
        weights = [torch.randn(n, k) * k**-0.5 for _ in range(built) for k, n in shapes]
        if args.lm_head:
            weights.append(torch.randn(vocab, hidden) * hidden**-0.5)
        packings = {name: [KINDS[name](w, None) for w in weights] for name in names}
        del weights
        scale = layers / built
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k) for k in {hidden, intermediate}}
            times: dict[str, list[float]] = {name: [] for name in packings}
            for _ in range(args.rounds):
                for name, linears in packings.items():
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        for linear in linears:
                            linear(inputs[linear.in_features])
                    times[name].append((time.perf_counter() - started) / args.calls)
            ms = {name: statistics.median(times[name][1:]) * 1e3 * scale for name in names}
            print(f"| {model} | {rows} | " + " | ".join(f"{ms[name]:.2f}" for name in names) + " | "
                  + " | ".join(f"{ms['onednn'] / ms[name]:.2f}" for name in others) + " |", flush=True)
        del packings


if __name__ == "__main__":
    main()
