"""The host path of two versions side by side in one process, step by step (``pagedllm bench overhead``'s engine).

This host's speed drifts by 1.5-2.5x over minutes, so two processes run one after the other
compare the host, not the code. Here both engines live in one interpreter and take turns, one
step each (the order swapped every step), so both see the same drift; the ratio of their median
step is the comparison.

- ``--base DIR``: the working tree's ``pagedllm`` against the one in ``DIR/backend`` (for example
  a worktree: ``git worktree add --detach /tmp/base <commit>``). Each version is imported with the
  other's modules out of ``sys.modules``, and its own are put back before each of its steps. The
  garbage collector's settings are the process's, so they are the same for both (the newer sets them).
- ``--young-thresholds A,B``: one engine, the garbage collector's youngest-generation threshold
  switched between A and B step by step (the lever in ``pagedllm.platform.gc_tuning``).

Usage: .venv/bin/python scripts/ab_host_path.py --base /tmp/base [--running 64,256] [--steps 320]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

PROMPT_LEN = 128
WARMUP_STEPS = 40
BLOCK_SIZE = 16


class BusyEngine:
    """An engine with a null forward, kept at ``n`` requests: finished ones are replaced at once."""

    def __init__(self, n: int) -> None:
        import pagedllm_bench.overhead as overhead
        from pagedllm.core.sampling_params import SamplingParams

        self.engine = overhead._engine(n, PROMPT_LEN, 4 * WARMUP_STEPS, BLOCK_SIZE).engine
        overhead._install_null_forward(self.engine)
        self.n = n
        self._params = SamplingParams
        self._rng = np.random.default_rng(n)
        self._arrivals = 0
        self.top_up()
        for _ in range(WARMUP_STEPS):  # everyone prefilled, lengths staggered
            self.step_ms()

    def top_up(self) -> None:
        stats = self.engine.stats()
        for _ in range(self.n - stats.num_running - stats.num_waiting):
            max_tokens = int(self._rng.integers(WARMUP_STEPS // 2 + 1, 3 * WARMUP_STEPS + 2))
            params = self._params(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            prompt = [int(t) for t in self._rng.integers(1, 2000, PROMPT_LEN)]
            self.engine.add_request(str(self._arrivals), prompt, params)
            self._arrivals += 1

    def step_ms(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        elapsed = 1000 * (time.perf_counter() - start)
        self.top_up()
        return elapsed


def _pagedllm_modules() -> dict[str, ModuleType]:
    return {name: module for name, module in sys.modules.items() if name == "pagedllm" or name.startswith("pagedllm.")}


def _load(n: int, package_parent: Path | None) -> tuple[BusyEngine, dict[str, ModuleType]]:
    """An engine built from the ``pagedllm`` under ``package_parent`` (None: the installed one)."""
    for name in _pagedllm_modules():
        del sys.modules[name]
    if package_parent is not None:
        sys.path.insert(0, str(package_parent))
    try:
        busy = BusyEngine(n)
    finally:
        if package_parent is not None:
            sys.path.remove(str(package_parent))
    return busy, _pagedllm_modules()


def compare_versions(base: Path, sizes: list[int], steps: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        package_parent = Path(scratch)
        (package_parent / "pagedllm").symlink_to((base / "backend").resolve())
        print(f"| running | base ms ({base}) | working tree ms | working tree / base |")
        print("|---|---|---|---|")
        for n in sizes:
            versions = {"base": _load(n, package_parent), "new": _load(n, None)}
            times = _alternate(versions, steps, lambda name: sys.modules.update(versions[name][1]))
            _print_row(n, times["base"], times["new"])


def compare_thresholds(thresholds: tuple[int, int], sizes: list[int], steps: int) -> None:
    saved = gc.get_threshold()
    print(f"| running | young threshold {thresholds[0]} ms | {thresholds[1]} ms | ratio |")
    print("|---|---|---|---|")
    try:
        for n in sizes:
            busy = BusyEngine(n)
            versions = {str(t): (busy, {}) for t in thresholds}
            times = _alternate(versions, steps, lambda name: gc.set_threshold(int(name), *saved[1:]))
            _print_row(n, times[str(thresholds[0])], times[str(thresholds[1])])
    finally:
        gc.set_threshold(*saved)


def _alternate(versions: dict[str, tuple[BusyEngine, Any]], steps: int,
               switch_to: Callable[[str], object]) -> dict[str, list[float]]:
    """``steps`` timed steps per version, taking turns, the order swapped every round."""
    names = list(versions)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(steps):
        for name in names if round_index % 2 == 0 else reversed(names):
            switch_to(name)
            times[name].append(versions[name][0].step_ms())
    return times


def _print_row(n: int, first: list[float], second: list[float]) -> None:
    a, b = statistics.median(first), statistics.median(second)
    print(f"| {n} | {a:.3f} | {b:.3f} | {b / a:.3f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", type=Path, help="a checkout whose backend/ is the version to compare against")
    which.add_argument("--young-thresholds", help="two gc thresholds for the youngest generation, e.g. 700,20000")
    parser.add_argument("--running", default="64,256", help="comma-separated numbers of running requests")
    parser.add_argument("--steps", type=int, default=320, help="timed steps per version and size")
    args = parser.parse_args()
    sizes = [int(n) for n in args.running.split(",")]
    if args.base is not None:
        if not (args.base / "backend" / "__init__.py").is_file():
            raise SystemExit(f"--base {args.base}: no backend/__init__.py there")
        compare_versions(args.base, sizes, args.steps)
    else:
        first, second = (int(t) for t in args.young_thresholds.split(","))
        compare_thresholds((first, second), sizes, args.steps)


if __name__ == "__main__":
    main()
