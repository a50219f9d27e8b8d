"""A layer's elementwise steps on the CPU, side by side: torch ops against the compiled fused routines.

Printed by ``pagedllm bench kernels`` on CPU, for the benchmark checkpoints'
shapes at the row counts a step has (a long tail's last decodes, a decode
batch, a prefill chunk). Each pair runs interleaved in one process on the same
inputs; the median of ``reps`` runs. The fused side is what the model runs
when :mod:`pagedllm.layers.cpu_fused_ops` builds.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm_bench.cpu_attention import interleaved
from pagedllm.layers.cpu_fused_ops import CpuFusedOps
from pagedllm.layers.norm_rotary import RMSNorm, apply_rotary
from pagedllm.testing.tiny_model import SIZES


@dataclass(frozen=True, slots=True)
class FusedRow:
    shape: str
    torch_ms: float
    fused_ms: float
    max_error: float  # max |fused - torch| / max |torch|

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.fused_ms


def fused_rows(ops: CpuFusedOps, sizes: tuple[str, ...], rows: tuple[int, ...], reps: int) -> list[FusedRow]:
    results = []
    generator = torch.Generator().manual_seed(4)
    for size in sizes:
        shape = SIZES[size]
        head_dim = shape.hidden_size // shape.num_heads
        for count in rows:
            steps = {
                "residual add + RMSNorm": _norm(ops, count, shape.hidden_size, generator),
                "rotary of q and k": _rotary(ops, count, shape.num_heads, shape.num_kv_heads, head_dim, generator),
                "SiLU(gate) x up": _silu(ops, count, shape.intermediate_size, generator),
            }
            for name, (plain, fused) in steps.items():
                times = interleaved({"torch": plain, "fused": fused}, reps)
                expected, actual = torch.cat(plain(), dim=-1), torch.cat(fused(), dim=-1)
                error = float((actual - expected).abs().max() / expected.abs().max())
                results.append(FusedRow(f"{size} {name}, {count} rows", times["torch"], times["fused"], error))
    _print(results)
    return results


# (torch ops, fused routine); each returns its results as [rows, ...] tensors to compare.
Step = tuple[Callable[[], tuple[torch.Tensor, ...]], Callable[[], tuple[torch.Tensor, ...]]]


def _norm(ops: CpuFusedOps, count: int, hidden: int, generator: torch.Generator) -> Step:
    x, residual = torch.randn(count, hidden, generator=generator), torch.randn(count, hidden, generator=generator)
    plain, fused = RMSNorm(hidden, 1e-6), RMSNorm(hidden, 1e-6, ops)
    # The fused add writes into its residual, so each call gets a fresh copy; the torch side copies too.
    return (lambda: plain.add_and_norm(x, residual.clone()), lambda: fused.add_and_norm(x, residual.clone()))


def _rotary(ops: CpuFusedOps, count: int, heads: int, kv_heads: int, head_dim: int,
            generator: torch.Generator) -> Step:
    qkv = torch.randn(count, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(count, 1, head_dim // 2, generator=generator) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def plain() -> tuple[torch.Tensor, ...]:
        q, k, _ = qkv.split(sizes, dim=-1)
        return (apply_rotary(q.view(count, heads, head_dim), cos, sin).reshape(count, -1),
                apply_rotary(k.view(count, kv_heads, head_dim), cos, sin).reshape(count, -1))

    def fused() -> tuple[torch.Tensor, ...]:
        rotated = qkv.clone()  # in place: each call rotates a fresh copy
        ops.rotate_(rotated, cos, sin, heads + kv_heads, head_dim)
        return (rotated[:, :sizes[0] + sizes[1]],)

    return plain, fused


def _silu(ops: CpuFusedOps, count: int, width: int, generator: torch.Generator) -> Step:
    gate_up = torch.randn(count, 2 * width, generator=generator) * 4

    def plain() -> tuple[torch.Tensor, ...]:
        gate, up = gate_up.split(width, dim=-1)
        return (F.silu(gate) * up,)

    return plain, lambda: (ops.silu_mul(gate_up),)


def _print(rows: list[FusedRow]) -> None:
    print(f"CPU elementwise steps of a layer, float32 ({torch.get_num_threads()} thread(s)): torch ops against the "
          "fused routines (pagedllm.layers.cpu_fused_ops); the fused rotary's time includes a copy of qkv, since it "
          "rotates in place\n")
    print("| step | torch ms | fused ms | speed-up | max rel. diff |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.shape} | {row.torch_ms:.4f} | {row.fused_ms:.4f} | {row.speedup:.2f}x | {row.max_error:.1e} |")
    print()
