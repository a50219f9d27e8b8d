"""Host path per engine step (everything but the model forward) at 64 / 256 / 1024 running requests.

A real ``LLMEngine`` on the tiny checkpoint runs with its forward replaced by
a null forward: the step is scheduled, the persistent input batch is filled
and the attention plan built as for a real forward, then fixed logits come
back instead of the model's. Everything else is the production path:
sampling on those logits, ``update_from_output``, detokenization, stop
strings and building the per-request outputs. Requests finish and arrive
during the timed steps (each has its own length; finished ones are replaced
at once by new prompts, whose prefill is in the timed steps too), so the
table is the steady state of a busy server. The last column, a real step of
the tiny model at the same N, gives the host path's share.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from pagedllm_bench import report
from pagedllm_bench.models import bench_model
from pagedllm.core.sampling_params import SamplingParams

PHASES = ("schedule", "prepare", "sample", "update", "outputs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--running", default="64,256,1024", help="comma-separated numbers of running requests")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60, help="timed host-path steps per size")
    parser.add_argument("--model-steps", type=int, default=5, help="timed real engine steps per size; 0 skips")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="small sizes, few steps (for tests)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    sizes = [4, 16] if args.tiny else [int(n) for n in args.running.split(",")]
    steps, model_steps, prompt_len = (4, 1, 8) if args.tiny else (args.steps, args.model_steps, args.prompt_len)
    if min(sizes) < 1 or steps < 1:
        raise ValueError("--running sizes and --steps must be >= 1")
    info = report.machine()
    print(report.header("pagedllm bench overhead", info))
    rows = []
    for n in tqdm(sizes, desc="sizes"):
        row: dict[str, Any] = {"running": n, **host_path_step(n, prompt_len, steps, args.block_size)}
        row["engine_step_ms"] = engine_step_ms(n, prompt_len, model_steps, args.block_size) if model_steps else None
        row["host_share"] = row["host_ms"] / row["engine_step_ms"] if row["engine_step_ms"] else None
        rows.append(row)
    print(f"## host path per step, prompt {prompt_len} tokens, block {args.block_size}: median over {steps} steps "
          "with requests finishing and arriving; phases are medians too, so they need not add up\n")
    print(report.markdown_table(
        ("running", "host path ms", *(f"{phase} ms" for phase in PHASES), "µs / request", "finished / step",
         "tiny engine step ms", "host share"),
        [[r["running"], r["host_ms"], *(r[f"{phase}_ms"] for phase in PHASES), 1000 * r["host_ms"] / r["running"],
          r["finished_per_step"], r["engine_step_ms"],
          None if r["host_share"] is None else f"{100 * r['host_share']:.0f}%"] for r in rows]))
    report.write_json(args.out / "overhead.json", {"machine": info, "prompt_len": prompt_len, "rows": rows})
    print(f"wrote {args.out / 'overhead.json'}")


def host_path_step(n: int, prompt_len: int, steps: int, block_size: int) -> dict[str, float]:
    """Median ms of a whole ``LLMEngine.step()`` with a null forward, and of each phase in it."""
    llm = _engine(n, prompt_len, 4 * steps, block_size)
    engine = llm.engine
    timings: dict[str, list[float]] = {phase: [] for phase in PHASES}
    _install_null_forward(engine)
    _time_phases(engine, timings)
    rng = np.random.default_rng(n)
    arrivals = iter(range(1 << 30))

    def top_up() -> None:
        while engine.stats().num_running + engine.stats().num_waiting < n:
            max_tokens = int(rng.integers(steps // 2 + 1, 3 * steps + 2))
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            engine.add_request(str(next(arrivals)), [int(t) for t in rng.integers(1, 2000, prompt_len)], params)

    top_up()
    for _ in range(steps):  # warm up: everyone prefilled, lengths staggered
        engine.step()
        top_up()
    for values in timings.values():
        values.clear()
    totals, finished = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        totals.append(1000 * (time.perf_counter() - start))
        finished += sum(out.finished for out in outputs)
        top_up()
    result = {f"{phase}_ms": statistics.median(values) if values else 0.0 for phase, values in timings.items()}
    return {"host_ms": statistics.median(totals), "finished_per_step": finished / steps, **result}


def engine_step_ms(n: int, prompt_len: int, steps: int, block_size: int) -> float:
    """Median wall ms of one real ``LLMEngine.step()`` of the tiny model decoding ``n`` requests."""
    llm = _engine(n, prompt_len, steps + 8, block_size)
    engine = llm.engine
    rng = np.random.default_rng(n)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0.0)
    for i in range(n):
        engine.add_request(str(i), [int(t) for t in rng.integers(1, 2000, prompt_len)], params)
    while any(seq.num_output_tokens == 0 for seq in [*engine.scheduler.running, *engine.scheduler.waiting]):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _engine(n: int, prompt_len: int, max_tokens: int, block_size: int) -> Any:
    from pagedllm import LLM

    max_model_len = prompt_len + max_tokens + 8
    blocks = n * -(-max_model_len // block_size) + 1
    return LLM(model=str(bench_model("tiny")), dtype="float32", block_size=block_size, num_kv_blocks=blocks,
               max_num_seqs=n, max_num_batched_tokens=max(2048, n), max_model_len=max_model_len)


def _install_null_forward(engine: Any) -> None:
    """Replace only the model forward: prepare and plan run as in a real step, fixed logits come back."""
    runner = engine.runner
    vocab = engine.model.vocab_size
    logits = torch.randn(engine.scheduler.max_num_seqs, vocab, generator=torch.Generator().manual_seed(0))

    def execute(step: Any) -> torch.Tensor:
        inputs = runner.prepare(step)
        runner.attention.plan(inputs.attn)
        return logits[: inputs.logits_indices.numel()]

    runner.execute = execute


def _time_phases(engine: Any, timings: dict[str, list[float]]) -> None:
    """Wrap the step's phases with timers (each phase is one call per step)."""
    def timed(owner: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timings[phase].append(1000 * (time.perf_counter() - start))

        setattr(owner, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.runner, "prepare", "prepare")
    timed(engine, "_sample", "sample")
    timed(engine.scheduler, "update_from_output", "update")
    timed(engine, "_emit_all", "outputs")
