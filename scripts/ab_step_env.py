"""Two engines in one process, built under two environments or from two versions, timed step by step in turns.

    OMP_NUM_THREADS=1 python scripts/ab_step_env.py --model qwen2.5-0.5b --dtype bfloat16 \
        --a PAGEDLLM_CPU_LINEAR=mkl --b PAGEDLLM_CPU_LINEAR=mkl-packed
    git archive <commit> backend | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python -P scripts/ab_step_env.py --base /tmp/base

Each engine is loaded with its switches set, from a fresh import of ``pagedllm`` (so each builds and
reads its own compiled routines): with ``--base DIR``, engine A's is the one in ``DIR/backend`` and
B's the working tree's, and each version's modules are put back in ``sys.modules`` before each of its
steps. Both get the same ``--batch`` greedy requests, and then the two alternate: one decode step of A,
one of B (the order swapped every round), ``--steps`` times; then prefill steps of ``--prompt-len``
tokens in turns. A slow spell of a shared host lands on both alike. Prints the medians, the B/A speed-up,
and whether both produced the same tokens.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from pagedllm_bench.models import bench_model


class Engine:
    """An ``LLM`` built from one version of ``pagedllm``, with that version's modules, put back before each step."""

    def __init__(self, checkpoint: Path, dtype: str, switches: list[str], batch: int, max_len: int,
                 package_parent: Path | None) -> None:
        for name in _pagedllm_modules():
            del sys.modules[name]
        saved = dict(os.environ)
        if package_parent is not None:
            sys.path.insert(0, str(package_parent))
        try:
            for switch in switches:
                name, _, value = switch.partition("=")
                os.environ[name] = value
            self.package = importlib.import_module("pagedllm")
            self.llm = self.package.LLM(str(checkpoint), dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=2048,
                                        max_model_len=max_len, enable_prefix_caching=False)
        finally:
            os.environ.clear()
            os.environ.update(saved)
            if package_parent is not None:
                sys.path.remove(str(package_parent))
        self.modules = _pagedllm_modules()

    def add_greedy(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        sys.modules.update(self.modules)  # the package resolves some names lazily, through sys.modules
        params = self.package.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.llm.engine.add_request(request_id, prompt, params)

    def step(self) -> list[Any]:
        sys.modules.update(self.modules)
        return self.llm.engine.step()

    def timed_step(self) -> float:
        started = time.perf_counter()
        self.step()
        return (time.perf_counter() - started) * 1e3


def _stub_linears(cpu_linear: ModuleType) -> None:
    """Make one version's packed linears return a zeroed buffer of their output's shape, one per linear and row
    count: the step keeps every call around them and loses the GEMMs, whose share would hide the rest."""
    buffers: dict[tuple[int, int], torch.Tensor] = {}

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        key = (id(self), x.shape[0])
        if key not in buffers:
            buffers[key] = torch.zeros(x.shape[0], self.out_features, dtype=x.dtype)
        return buffers[key]

    for name in ("PackedLinear", "OneDnnLinear", "MklPackedLinear"):
        getattr(cpu_linear, name).forward = forward


def _pagedllm_modules() -> dict[str, ModuleType]:
    return {name: module for name, module in sys.modules.items() if name == "pagedllm" or name.startswith("pagedllm.")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--a", nargs="*", default=[], help="NAME=VALUE switches of engine A")
    parser.add_argument("--b", nargs="*", default=[], help="NAME=VALUE switches of engine B")
    parser.add_argument("--dtype-b", default=None, help="engine B's dtype, when it differs")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prefills", type=int, default=3)
    parser.add_argument("--base", type=Path, default=None,
                        help="a tree whose backend/ is engine A's pagedllm (B's is the working tree's)")
    parser.add_argument("--stub-linears", action="store_true",
                        help="packed linears answer from a buffer instead of computing, in both engines: times the "
                             "step's work outside its linears (the tokens are then meaningless, but alike)")
    args = parser.parse_args()
    max_len = max(args.context, args.prompt_len) + args.steps + 16
    checkpoint = bench_model(args.model)
    # Kept for the whole run: engine A's routines built on first use (the MoE experts) find their sources
    # through this link.
    scratch = tempfile.TemporaryDirectory()
    package_parent = None
    if args.base is not None:
        package_parent = Path(scratch.name)
        (package_parent / "pagedllm").symlink_to((args.base / "backend").resolve())
    engines = {"A": Engine(checkpoint, args.dtype, args.a, args.batch, max_len, package_parent),
               "B": Engine(checkpoint, args.dtype_b or args.dtype, args.b, args.batch, max_len, None)}
    if args.stub_linears:
        for engine in engines.values():
            _stub_linears(engine.modules["pagedllm.layers.cpu_linear"])
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (args.context,), generator=generator).tolist() for _ in range(args.batch)]
    long_prompt = torch.randint(3, 2000, (args.prompt_len,), generator=generator).tolist()
    tokens: dict[str, list[list[int]]] = {}
    decode: dict[str, list[float]] = {"A": [], "B": []}
    prefill: dict[str, list[float]] = {"A": [], "B": []}
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_greedy(f"d{i}", prompt, args.steps + 3)
        engine.step()
        engine.step()
    for round_index in range(args.steps):
        for name in "AB" if round_index % 2 == 0 else "BA":
            decode[name].append(engines[name].timed_step())
    for name, engine in engines.items():
        outputs = []
        while engine.llm.engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        tokens[name] = [o.outputs[0].token_ids for o in sorted(outputs, key=lambda o: o.request_id)]
    for i in range(args.prefills + 1):
        for name in "AB" if i % 2 == 0 else "BA":
            engines[name].add_greedy(f"p{i}", long_prompt, 1)
            took = engines[name].timed_step()
            if i:  # the first warms the prefill path
                prefill[name].append(took)
    versions = f"; A from {args.base}, B from the working tree" if args.base is not None else ""
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s); A={args.a} B={args.b}{versions}")
    for label, table in ((f"decode step, batch {args.batch}", decode), (f"prefill step, {args.prompt_len} tokens",
                                                                        prefill)):
        a, b = statistics.median(table["A"]), statistics.median(table["B"])
        print(f"{label}: A {a:.1f} ms, B {b:.1f} ms (median of {len(table['A'])}); B is {a / b:.2f}x A's speed")
        print("  A", [round(t) for t in table["A"]], "\n  B", [round(t) for t in table["B"]])
    same = tokens["A"] == tokens["B"]
    print(f"greedy tokens of the decode batch: {'identical' if same else 'DIFFER'}")
    for engine in engines.values():
        engine.llm.close()
    scratch.cleanup()


if __name__ == "__main__":
    main()
