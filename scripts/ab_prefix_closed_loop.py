"""The prefix_repetition serving shape in-process, two versions of the engine stepping in turns.

    git archive <commit> backend | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 .venv/bin/python -P scripts/ab_prefix_closed_loop.py --base /tmp/base

The shape of ``scripts/prefix_closed_loop.py`` (``--streams`` requests kept in flight over ``--num-prefixes``
shared ``--prefix-len``-token prefixes, ``--suffix-len``-token suffixes, ``--output-len`` tokens out), replayed
by two engines at once: A from ``DIR/backend``, B from the working tree, each version's modules put back in
``sys.modules`` before each of its steps (as ``scripts/ab_step_env.py`` does). They alternate one step each,
the order swapped every round, so a slow spell of a shared host lands on both alike. Both see the same
requests in the same order and run the same schedule, so their steps pair up: prints the median decode-only
step (no prompt token in it) and the summed step time of each, their ratio, and whether both produced the same
tokens.
"""
from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from pagedllm_bench.models import bench_model


class ClosedLoop:
    """One version's engine, kept at ``streams`` requests in flight from a shared queue of prompts."""

    def __init__(self, checkpoint: Path, package_parent: Path | None, prompts: list[list[int]],
                 args: argparse.Namespace) -> None:
        for name in _pagedllm_modules():
            del sys.modules[name]
        if package_parent is not None:
            sys.path.insert(0, str(package_parent))
        try:
            config = importlib.import_module("pagedllm.core.config")
            engine_module = importlib.import_module("pagedllm.engine.llm_engine")
            sampling = importlib.import_module("pagedllm.core.sampling_params")
        finally:
            if package_parent is not None:
                sys.path.remove(str(package_parent))
        settings = {"model": str(checkpoint), "dtype": "float32", "device": "cpu", "block_size": 16,
                    "max_model_len": 1024, "max_num_seqs": 64, "seed": 0}
        self.engine = engine_module.LLMEngine(config.EngineConfig.from_dict(settings))
        self.modules = _pagedllm_modules()
        self.params = sampling.SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        self.engine.add_request("warm-up", [1, 2, 3], sampling.SamplingParams(max_tokens=2))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.queued = list(prompts)
        self.streams = args.streams
        self.in_flight = 0
        self.tokens: dict[str, list[int]] = {}
        self.decode_ms: list[float] = []
        self.total_ms = 0.0

    def busy(self) -> bool:
        return bool(self.queued) or self.engine.has_unfinished_requests()

    def step(self) -> None:
        sys.modules.update(self.modules)  # the package resolves some names lazily, through sys.modules
        while self.queued and self.in_flight < self.streams:
            self.engine.add_request(str(len(self.queued)), self.queued.pop(), self.params)
            self.in_flight += 1
        prompt_tokens = self.engine.stats().prompt_tokens_total
        started = time.perf_counter()
        outputs = self.engine.step()
        elapsed = (time.perf_counter() - started) * 1e3
        self.total_ms += elapsed
        # A step that completed no prompt and started none is a decode step (no request was waiting).
        if self.engine.stats().prompt_tokens_total == prompt_tokens and not self.engine.scheduler.waiting:
            self.decode_ms.append(elapsed)
        for output in outputs:
            for delta in output.outputs:
                self.tokens.setdefault(output.request_id, []).extend(delta.token_ids)
            self.in_flight -= output.finished


def _pagedllm_modules() -> dict[str, ModuleType]:
    return {name: module for name, module in sys.modules.items() if name == "pagedllm" or name.startswith("pagedllm.")}


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    made = [prefix + [rng.randrange(vocab) for _ in range(args.suffix_len)]
            for prefix in prefixes for _ in range(args.num_prompts // args.num_prefixes)]
    rng.shuffle(made)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, required=True, help="a tree whose backend/ is engine A's pagedllm")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    checkpoint = bench_model("tiny", args.arch)
    prompts = _prompts(args, 2048)
    scratch = tempfile.TemporaryDirectory()
    package_parent = Path(scratch.name)
    (package_parent / "pagedllm").symlink_to((args.base / "backend").resolve())
    loops: dict[str, Any] = {"A": ClosedLoop(checkpoint, package_parent, prompts, args),
                             "B": ClosedLoop(checkpoint, None, prompts, args)}
    round_index = 0
    while any(loop.busy() for loop in loops.values()):
        for name in "AB" if round_index % 2 == 0 else "BA":
            if loops[name].busy():
                loops[name].step()
        round_index += 1
    a, b = loops["A"], loops["B"]
    decode_a, decode_b = statistics.median(a.decode_ms), statistics.median(b.decode_ms)
    print(f"decode steps: A {len(a.decode_ms)} at median {decode_a:.3f} ms, B {len(b.decode_ms)} at "
          f"{decode_b:.3f} ms: B/A {decode_b / decode_a:.3f}")
    print(f"all steps: A {a.total_ms:.0f} ms, B {b.total_ms:.0f} ms: B/A {b.total_ms / a.total_ms:.3f}")
    print(f"same tokens: {a.tokens == b.tokens}")


if __name__ == "__main__":
    main()
