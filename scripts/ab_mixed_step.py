"""Steps that mix decodes with a new prompt, from two versions of pagedllm in one process, timed in turns.

    git archive <commit> backend | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python -P scripts/ab_mixed_step.py --base /tmp/base --model qwen2.5-0.5b

What a busy server's steps look like when requests outnumber the running sequences: ``--batch``
sequences decoding at about ``--context`` tokens, and in each step one new request's prompt of
``--prompt-len`` tokens prefilled beside them (asking for one token, so the batch stays the same size).
Engine A is the package in ``DIR/backend``, B the working tree's (:class:`ab_step_env.Engine`: each
version's modules are put back before each of its steps); their steps alternate, the order swapped
every round, so a slow spell of a shared host lands on both. Prints the median step of each and B's
speed over A's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from ab_step_env import Engine
from pagedllm_bench.models import bench_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--base", type=Path, required=True, help="a tree whose backend/ is engine A's pagedllm")
    parser.add_argument("--batch", type=int, default=31, help="sequences decoding in every timed step")
    parser.add_argument("--context", type=int, default=300, help="their prompts' tokens")
    parser.add_argument("--prompt-len", type=int, default=128, help="the new prompt of each timed step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each engine")
    args = parser.parse_args()
    checkpoint = bench_model(args.model)
    max_len = max(args.context + 2 * args.steps + 16, args.prompt_len + 8)
    with tempfile.TemporaryDirectory() as scratch:
        package_parent = Path(scratch)
        (package_parent / "pagedllm").symlink_to((args.base / "backend").resolve())
        engines = {"A": Engine(checkpoint, args.dtype, [], args.batch + 1, max_len, package_parent),
                   "B": Engine(checkpoint, args.dtype, [], args.batch + 1, max_len, None)}
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (args.context,), generator=generator).tolist() for _ in range(args.batch)]
    new_prompts = [torch.randint(3, 2000, (args.prompt_len,), generator=generator).tolist()
                   for _ in range(args.steps + 1)]
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_greedy(f"d{i}", prompt, 2 * args.steps + 8)
        scheduler = engine.llm.engine.scheduler
        # Prefill the batch: every sequence past its prompt, so that the timed steps decode all of them.
        while len(scheduler.running) < args.batch or any(s.num_computed_tokens < args.context
                                                           for s in scheduler.running):
            engine.step()
    times: dict[str, list[float]] = {"A": [], "B": []}
    load = os.getloadavg()[0]
    for i, prompt in enumerate(new_prompts):
        for name in "AB" if i % 2 == 0 else "BA":
            engines[name].add_greedy(f"p{i}", prompt, 1)
            took = engines[name].timed_step()
            if i:  # the first warms the mixed path
                times[name].append(took)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s); A from {args.base}, B from the working "
          f"tree; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"mixed step, {args.batch} decodes at ~{args.context} + a {args.prompt_len}-token prompt: A {a:.1f} ms, "
          f"B {b:.1f} ms (median of {len(times['A'])}); B is {a / b:.3f}x A's speed")
    print("  A", [round(t) for t in times["A"]], "\n  B", [round(t) for t in times["B"]])
    for engine in engines.values():
        engine.llm.close()


if __name__ == "__main__":
    main()
