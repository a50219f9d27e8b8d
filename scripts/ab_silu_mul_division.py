"""The compiled SiLU-and-multiply before and after a change to ``cpu_fused.c``, side by side: same bits, and time.

    OMP_NUM_THREADS=1 python scripts/ab_silu_mul_division.py [--old REV] [--rows 1,16,512] [--widths 4864,8960]

``--old`` names a git revision whose ``backend/layers/cpu_fused.c`` (and the header it includes) is the
"old" side; the "new" side is this worktree's. Both are built with the flags the engine uses. The new side
is called through :class:`CpuFusedOps`; the old side through ctypes with the signature its routines had
before the bf16 one took torch's silu table (:class:`OldSiluMul`), which every ``--old`` before that
change has.

Bits: float32 and bf16 outputs are compared as integers (so NaN patterns count too) on every bf16 gate
value, on a sweep through float32 bit patterns, and on Gaussian rows: old against new, and new against
torch's ``F.silu(gate) * up``. Time: rounds interleaved (a busy
spell of a shared host hits both sides alike), median µs per call, on rows of Qwen2.5's intermediate
widths (0.5B 4864, 1.5B 8960).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.layers import cpu_fused_ops
from pagedllm.layers.cpu_fused_ops import CpuFusedOps, _dense
from pagedllm.platform.native_build import load_library

logger = logging.getLogger("ab_silu_mul_division")
ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path("backend/layers/cpu_fused.c")


def _old_source(revision: str, into: Path) -> Path:
    """``cpu_fused.c`` at ``revision`` written under ``into`` with its included headers at their relative places."""
    def show(path: Path) -> str:
        return subprocess.run(["git", "show", f"{revision}:{path.as_posix()}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout

    text = show(SOURCE)
    target = into / SOURCE
    target.parent.mkdir(parents=True)
    target.write_text(text)
    for header in re.findall(r'^#include "([^"]+)"', text, re.MULTILINE):
        header_path = (SOURCE.parent / header)
        resolved = Path(*_normalized(header_path.parts))
        (into / resolved).parent.mkdir(parents=True, exist_ok=True)
        (into / resolved).write_text(show(resolved))
    return target


def _normalized(parts: tuple[str, ...]) -> list[str]:
    """A relative path's parts with ``..`` resolved lexically (git show needs a clean repository path)."""
    out: list[str] = []
    for part in parts:
        if part == "..":
            out.pop()
        elif part != ".":
            out.append(part)
    return out


def _library(source: Path) -> ctypes.CDLL:
    # The engine's own flags: cpu_fused_ops builds with these extras.
    library = load_library(source, "PAGEDLLM_AB_NEVER_OFF", "nothing to compare", logger, ("-ffp-contract=off",))
    if library is None:
        raise SystemExit(f"{source} did not build")
    return library


class OldSiluMul:
    """An old library's SiLU-and-multiply, both dtypes taking (gate_up, out, rows, width, threads)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._routines = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            routine = library[f"pagedllm_silu_mul_{suffix}"]
            routine.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
            routine.restype = None
            self._routines[dtype] = routine

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """:meth:`CpuFusedOps.silu_mul`, with its checks, so that both sides pay the same Python per call."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"silu_mul: expected rows of [gate | up] (even width), got {tuple(gate_up.shape)}")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=_dense(gate_up).dtype)
        self._routines[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
        return out


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _bit_check(old: OldSiluMul, new: CpuFusedOps) -> list[tuple[str, int, int, int]]:
    """(case, elements, elements whose bits differ old against new, new against torch) for each input family."""
    generator = torch.Generator().manual_seed(0)
    cases: list[tuple[str, torch.Tensor]] = []
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up16 = torch.randn(every_bf16.numel(), generator=generator).bfloat16()
    cases.append(("bf16: every gate value", torch.cat([every_bf16, up16]).reshape(1, -1)))
    gaussian16 = (torch.randn(512, 2 * 4864, generator=generator) * 4).bfloat16()
    cases.append(("bf16: gaussian x4, 512 x 4864", gaussian16))
    # Every 251st float32 bit pattern (~17M values: every exponent, signs, subnormals, inf, NaN), as gates.
    sweep = torch.arange(0, 2**32, 251, dtype=torch.int64).to(torch.int32).view(torch.float32)
    up32 = torch.randn(sweep.numel(), generator=generator)
    cases.append(("f32: every 251st bit pattern", torch.cat([sweep, up32]).reshape(1, -1)))
    gaussian32 = torch.randn(512, 2 * 4864, generator=generator) * 4
    cases.append(("f32: gaussian x4, 512 x 4864", gaussian32))
    results = []
    for name, gate_up in cases:
        gate, up = gate_up.chunk(2, dim=1)
        a, b, t = _as_bits(old.silu_mul(gate_up)), _as_bits(new.silu_mul(gate_up)), _as_bits(F.silu(gate) * up)
        results.append((name, a.numel(), int((a != b).sum()), int((b != t).sum())))
    return results


def _median_us(calls: dict[str, Callable[[], object]], rounds: int, repeat: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            call()
            started = time.perf_counter()
            for _ in range(repeat):
                call()
            times[name].append((time.perf_counter() - started) / repeat)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 750465a: the last cpu_fused.c whose bf16 SiLU computes the sigmoid (one division per element); af0775c: the
    # last with two divisions per element (a select between two quotients).
    parser.add_argument("--old", default="750465a", help="git revision of the old cpu_fused.c")
    parser.add_argument("--rows", default="1,16,512")
    parser.add_argument("--widths", default="4864,8960")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as staging:
        old = OldSiluMul(_library(_old_source(args.old, Path(staging))))
    new = CpuFusedOps(_library(cpu_fused_ops.SOURCE))
    print(f"old: {args.old}:{SOURCE}; new: worktree; torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
    print("| inputs | elements | differing bits, old vs new | new vs torch |\n|---|---|---|---|")
    for name, elements, differing, from_torch in _bit_check(old, new):
        print(f"| {name} | {elements} | {differing} | {from_torch} |")
    print("\n| dtype | rows × width | old µs | new µs | old / new |\n|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        for width in (int(w) for w in args.widths.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                gate_up = (torch.randn(rows, 2 * width, generator=generator) * 4).to(dtype)
                repeat = max(3, 200_000 // (rows * width) * 10)
                us = _median_us({"old": lambda: old.silu_mul(gate_up), "new": lambda: new.silu_mul(gate_up)},
                                args.rounds, repeat)
                print(f"| {str(dtype).removeprefix('torch.')} | {rows} × {width} | {us['old']:.1f} | "
                      f"{us['new']:.1f} | {us['old'] / us['new']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
