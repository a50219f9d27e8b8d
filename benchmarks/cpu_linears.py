"""CPU linears, side by side: ``F.linear`` (MKL) against the two packed weights the loader can use.

Printed by ``pagedllm bench kernels`` on CPU, for the benchmark checkpoints'
linear shapes (fused qkv, o, fused gate/up, down, LM head) at the row counts a
step has: a few decodes left in a long tail, a full decode batch, a prefill.
The three run interleaved in one process; the median of ``reps`` runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm_bench.cpu_attention import interleaved
from pagedllm.layers.cpu_linear import MklPackedLinear, OneDnnLinear, PackedLinear
from pagedllm.testing.tiny_model import SIZES


@dataclass(frozen=True, slots=True)
class LinearRow:
    shape: str
    mkl_ms: float  # F.linear
    onednn_ms: float
    packed_ms: float  # MKL packed GEMM (oneDNN packed is the loader's default)
    max_error: float  # max |packed - F.linear| / max |F.linear|, over both packed kinds

    @property
    def speedup(self) -> float:
        return self.mkl_ms / self.packed_ms


def linear_rows(sizes: tuple[str, ...], rows: tuple[int, ...], reps: int) -> list[LinearRow]:
    results = []
    generator = torch.Generator().manual_seed(2)
    for size in sizes:
        shape = SIZES[size]
        head_dim = shape.hidden_size // shape.num_heads
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * head_dim
        for name, (inputs, outputs) in {"qkv": (shape.hidden_size, qkv),
                                        "gate/up": (shape.hidden_size, 2 * shape.intermediate_size),
                                        "down": (shape.intermediate_size, shape.hidden_size),
                                        "lm head": (shape.hidden_size, shape.vocab_size)}.items():
            weight = torch.randn(outputs, inputs, generator=generator) * inputs**-0.5
            onednn, packed = OneDnnLinear(weight, None), MklPackedLinear(weight, None)
            for count in rows:
                x = torch.randn(count, inputs, generator=generator)
                times = interleaved({"mkl": lambda: F.linear(x, weight), "onednn": lambda: onednn(x),
                                     "packed": lambda: packed(x)}, reps)
                results.append(LinearRow(f"{size} {name} {inputs}x{outputs}, {count} rows", times["mkl"],
                                         times["onednn"], times["packed"],
                                         max(_relative_error(linear, x, weight) for linear in (onednn, packed))))
    _print(results)
    return results


def _relative_error(linear: PackedLinear, x: torch.Tensor, weight: torch.Tensor) -> float:
    expected = F.linear(x, weight)
    return float((linear(x) - expected).abs().max() / expected.abs().max())


def _print(rows: list[LinearRow]) -> None:
    print(f"CPU linears, float32 ({torch.get_num_threads()} thread(s)): F.linear (MKL) against oneDNN-packed and "
          "MKL-packed weights (pagedllm.layers.cpu_linear; oneDNN-packed is the default)\n")
    print("| shape | F.linear ms | oneDNN packed ms | MKL packed ms | MKL packed vs F.linear | MKL packed vs oneDNN "
          "| max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.shape} | {row.mkl_ms:.3f} | {row.onednn_ms:.3f} | {row.packed_ms:.3f} | {row.speedup:.2f}x "
              f"| {row.onednn_ms / row.packed_ms:.2f}x | {row.max_error:.1e} |")
    print()
