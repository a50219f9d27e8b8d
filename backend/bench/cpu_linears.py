"""CPU linears, side by side: ``F.linear`` (MKL) against the oneDNN-packed weights the loader uses.

Printed by ``pagedllm bench kernels`` on CPU, for the benchmark checkpoints'
linear shapes (fused qkv, o, fused gate/up, down, LM head) at the row counts a
step has: a few decodes left in a long tail, a full decode batch, a prefill.
Each pair runs interleaved in one process; the median of ``reps`` runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.bench.cpu_attention import interleaved
from pagedllm.models.cpu_linear import PackedLinear
from pagedllm.testing.tiny_model import SIZES


@dataclass(frozen=True, slots=True)
class LinearRow:
    shape: str
    mkl_ms: float
    packed_ms: float
    max_error: float  # max |packed - mkl| / max |mkl|

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
            packed = PackedLinear(weight, None)
            for count in rows:
                x = torch.randn(count, inputs, generator=generator)
                variants = {"mkl": lambda: F.linear(x, weight), "packed": lambda: packed(x)}
                times = interleaved(variants, reps)
                expected = F.linear(x, weight)
                error = float((packed(x) - expected).abs().max() / expected.abs().max())
                results.append(LinearRow(f"{size} {name} {inputs}x{outputs}, {count} rows", times["mkl"],
                                         times["packed"], error))
    _print(results)
    return results


def _print(rows: list[LinearRow]) -> None:
    print(f"CPU linears, float32 ({torch.get_num_threads()} thread(s)): F.linear (MKL) against oneDNN-packed weights "
          "(pagedllm.models.cpu_linear)\n")
    print("| shape | F.linear ms | packed ms | packed speed-up | max rel. diff |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.shape} | {row.mkl_ms:.3f} | {row.packed_ms:.3f} | {row.speedup:.2f}x | {row.max_error:.1e} |")
    print()
