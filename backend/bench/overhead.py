"""Control-path cost per step (scheduler, KV manager, input building) at 64 / 256 / 1024 running requests.

A null model stands in for the forward pass (``NullEngine``): the real
``Scheduler`` and ``KVCacheManager`` run steady-state decode steps for N
requests (each step every request computes one token and "samples" a fixed
one), and the real
``ModelRunner.prepare`` flattens each step into the tensors a forward would
take. Timed per step: ``schedule()``; the engine's bookkeeping after a
forward (advance computed tokens, publish full blocks' prefix hashes, append
the token); and ``prepare()``. For scale, the last columns time a whole
``LLMEngine.step()`` of the tiny model at the same N (real forward, sampler
and detokenizer): the control path's share of it is what the table is for.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from pagedllm.bench import report
from pagedllm.bench.models import bench_model
from pagedllm.bench.null_engine import NullEngine
from pagedllm.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--running", default="64,256,1024", help="comma-separated numbers of running requests")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per size (null model)")
    parser.add_argument("--model-steps", type=int, default=5, help="timed engine steps per size (tiny model); 0 skips")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="small sizes, few steps (for tests)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    sizes = [4, 16] if args.tiny else [int(n) for n in args.running.split(",")]
    steps, model_steps, prompt_len = (3, 1, 8) if args.tiny else (args.steps, args.model_steps, args.prompt_len)
    if min(sizes) < 1 or steps < 1:
        raise ValueError("--running sizes and --steps must be >= 1")
    info = report.machine()
    print(report.header("pagedllm bench overhead", info))
    runner = _null_runner(args.block_size)
    rows = []
    for n in tqdm(sizes, desc="sizes"):
        row = {"running": n, **null_model_step(n, prompt_len, steps, args.block_size, runner)}
        row["engine_step_ms"] = engine_step_ms(n, prompt_len, model_steps, args.block_size) if model_steps else None
        control = row["schedule_ms"] + row["update_ms"] + row["prepare_ms"]
        row["control_ms"] = control
        row["control_share"] = control / row["engine_step_ms"] if row["engine_step_ms"] else None
        rows.append(row)
    print(f"## decode steps, prompt {prompt_len} tokens, block {args.block_size}; median over {steps} null-model "
          f"steps and {model_steps} tiny-model engine steps\n")
    print(report.markdown_table(
        ("running", "schedule ms", "KV + bookkeeping ms", "prepare ms", "control path ms", "µs / request",
         "tiny engine step ms", "control share"),
        [[r["running"], r["schedule_ms"], r["update_ms"], r["prepare_ms"], r["control_ms"],
          1000 * r["control_ms"] / r["running"], r["engine_step_ms"],
          None if r["control_share"] is None else f"{100 * r['control_share']:.0f}%"] for r in rows]))
    report.write_json(args.out / "overhead.json", {"machine": info, "prompt_len": prompt_len, "rows": rows})
    print(f"wrote {args.out / 'overhead.json'}")


def null_model_step(n: int, prompt_len: int, steps: int, block_size: int, runner: Any) -> dict[str, float]:
    """Median ms per decode step of schedule / bookkeeping / prepare with ``n`` running requests."""
    max_tokens = _max_tokens(n, prompt_len, steps)
    blocks_per_seq = -(-(prompt_len + max_tokens) // block_size)
    engine = NullEngine(n * blocks_per_seq + 1, block_size, max_num_seqs=n, max_num_batched_tokens=_budget(n))
    rng = np.random.default_rng(n)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for _ in range(n):
        engine.add_request([int(t) for t in rng.integers(1, 2048, prompt_len)], params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_output_tokens == 0 for seq in scheduler.running):
        engine.step()  # prefill, untimed
    timings: dict[str, list[float]] = {"schedule_ms": [], "update_ms": [], "prepare_ms": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        runner.prepare(out)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, [7] * len(out.samples))
        t3 = time.perf_counter()
        if len(out.scheduled) != n or out.preempted:
            raise RuntimeError(f"expected {n} decodes and no preemption, got {len(out.scheduled)} scheduled")
        timings["schedule_ms"].append(1000 * (t1 - t0))
        timings["prepare_ms"].append(1000 * (t2 - t1))
        timings["update_ms"].append(1000 * (t3 - t2))
    return {key: statistics.median(values) for key, values in timings.items()}


def engine_step_ms(n: int, prompt_len: int, steps: int, block_size: int) -> float:
    """Median wall ms of one real ``LLMEngine.step()`` of the tiny model decoding ``n`` requests."""
    from pagedllm import LLM

    max_tokens = _max_tokens(n, prompt_len, steps)
    blocks = n * -(-(prompt_len + max_tokens) // block_size) + 1
    llm = LLM(model=str(bench_model("tiny")), dtype="float32", block_size=block_size, num_kv_blocks=blocks,
              max_num_seqs=n, max_num_batched_tokens=_budget(n), max_model_len=prompt_len + max_tokens)
    engine = llm.engine
    rng = np.random.default_rng(n)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(n):
        engine.add_request(str(i), [int(t) for t in rng.integers(1, 2048, prompt_len)], params)
    while any(seq.num_output_tokens == 0 for seq in [*engine.scheduler.running, *engine.scheduler.waiting]):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _budget(n: int) -> int:
    return max(2048, n)


def _max_tokens(n: int, prompt_len: int, steps: int) -> int:
    """Enough that nobody finishes during the timed steps: early requests decode while later ones prefill."""
    # Decodes share the step budget with the prefills, so prefilling everyone takes at most this many steps.
    prefill_steps = -(-n * prompt_len // max(_budget(n) - n, 1))
    return steps + prefill_steps + 8


def _null_runner(block_size: int) -> Any:
    """A ModelRunner with a one-block cache: ``prepare`` only builds host tensors and never touches the cache."""
    from pagedllm.worker.attention_backend import select_attention_backend
    from pagedllm.worker.model_runner import ModelRunner
    from pagedllm.models import load_model

    device = torch.device("cpu")
    attention = select_attention_backend(device)
    model = load_model(bench_model("tiny"), torch.float32, device, attention)
    return ModelRunner(model, attention, 1, block_size, torch.float32, device)
