"""End to end on a CUDA GPU: workloads, latency at a few request rates, continuous vs static, decode vs roofline.

``pagedllm bench gpu`` writes a random-weight checkpoint with a catalog
model's shapes (``--shape``, default Llama-3.1-8B, all its layers, bf16; no
download) and runs, with CUDA graphs on:

1. the long-tail, shared-prefix and branching-chat workloads, all requests at
   once, through a continuous-batching engine and a static-batching one
   (same batch cap, same GPU): output tokens/s each, their ratio (the seed
   claimed continuous batching is "up to 23x" static), and the KV waste
   (allocated slots holding no token, replayed on the engine's own scheduler).
   Each workload is ``--copies`` seeds of it submitted together, so there
   are more requests than the batch cap and static batches wait for their
   longest request;
2. the long-tail workload (one seed) arriving as Poisson traffic at each ``--qps``:
   TTFT and TPOT percentiles, tokens/s;
3. decode-only steps at each ``--batches`` size against the roofline: the
   bytes a step reads (every weight once, plus each sequence's K/V) over
   ``--bandwidth-gbs`` (the H200's 4.8 TB/s by default);
4. ``pagedllm plan``'s prediction for each rate, from the step-time model
   calibrated on this GPU (``planning.calibrate``, as ``pagedllm plan
   --calibrate`` does), against the measured run of 2.

On a machine without CUDA it refuses at once. Random weights make the text
meaningless but the arithmetic, the launches and the bytes real.
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pagedllm import LLM
from pagedllm_bench import report
from pagedllm_bench.engines import pagedllm_params
from pagedllm_bench.gpu_measures import (
    kv_waste,
    replay_at_rate,
    roofline_tokens_per_s,
    speedup,
    summarize_latency,
    timed_decode,
)
from pagedllm.planning.calibrate import calibrate, random_checkpoint
from pagedllm.planning.gpu_catalog import resolve_gpu
from pagedllm.planning.model_catalog import resolve_model, spec_from_config
from pagedllm.planning.replay import EngineLimits, replay
from pagedllm.planning.step_time import ModelCost, StepShape
from pagedllm.planning.traffic import from_workload_file
from pagedllm.simulation.workloads import Workload, make_workload

REFUSAL = "pagedllm bench gpu needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() is False)"
WORKLOADS = ("long-tail", "shared-prefix", "branching-chat")
SEED_CLAIM = 23.0  # the seed's "up to 23x" continuous over static batching
ROOFLINE_TARGET = 0.70  # of the roofline, at decode batch >= 64 with graphs
PLAN_TOLERANCE = 0.15


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="Llama-3.1-8B", help="catalog model whose layer shapes to use")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    parser.add_argument("--scale", choices=("full", "quick", "tiny"), default="full", help="workload scale")
    parser.add_argument("--copies", type=int, default=4,
                        help="seeds of each workload submitted together: more requests than the batch cap, so "
                             "static batching waits for each batch's longest request")
    parser.add_argument("--qps", default="16,64,256", help="comma-separated request rates for the latency runs")
    parser.add_argument("--batches", default="1,8,32,64,128,256", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=512, help="decode runs: prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="decode runs: output tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="batch cap of both engines")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=float, default=40.0, help="KV cache per engine")
    parser.add_argument("--bandwidth-gbs", type=float, default=resolve_gpu("H200").bandwidth_bytes_per_s / 1e9,
                        help="peak memory bandwidth of the roofline (default: the H200's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write every result to this JSON file")


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(REFUSAL)
    if args.copies < 1:
        raise SystemExit(f"--copies={args.copies} is invalid: expected >= 1")
    rates = _numbers(args.qps, float, "--qps")
    batches = _numbers(args.batches, int, "--batches")
    if max(batches) > args.max_num_seqs:
        raise SystemExit(f"--batches {max(batches)} exceeds --max-num-seqs {args.max_num_seqs}")
    # The random checkpoint is gigabytes: it goes when the benchmark ends.
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-gpu-") as scratch:
        start = time.perf_counter()
        checkpoint = random_checkpoint(resolve_model(args.shape), Path(scratch) / "model", args.layers)
        print(f"random checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
        _bench(args, checkpoint, rates, batches, Path(scratch))


def _bench(args: argparse.Namespace, checkpoint: Path, rates: list[float], batches: list[int], scratch: Path) -> None:
    """Each table is printed, and the JSON rewritten, as soon as it is measured: a timeout keeps what came before."""
    config = json.loads((checkpoint / "config.json").read_text())
    cost = ModelCost.of(spec_from_config(args.shape, config), "bfloat16", "bfloat16")
    workloads = {kind: _copies(kind, args.scale, args.seed, config["vocab_size"], args.copies) for kind in WORKLOADS}
    max_model_len = -(-max(max(w.max_len for w in workloads.values()), args.prompt_len + args.output_len) // 16) * 16
    settings = {"model": str(checkpoint), "dtype": "bfloat16", "device": "cuda", "cuda_graphs": True,
                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                "kv_cache_memory_gb": args.kv_cache_gb, "max_model_len": max_model_len, "seed": args.seed}
    print(f"# pagedllm bench gpu: {torch.cuda.get_device_name()}, {args.shape} shapes, "
          f"{config['num_hidden_layers']} layers, bf16, CUDA graphs on, batch cap {args.max_num_seqs}, "
          f"weights {cost.weights_bytes / 1e9:.1f} GB (vocabulary {config['vocab_size']}: the embedded tokenizer's)\n",
          flush=True)
    long_tail = make_workload("long-tail", args.scale, args.seed, config["vocab_size"]).save(scratch / "long-tail.json")
    traffic = {rate: from_workload_file(long_tail, rate, args.seed) for rate in rates}
    options = {key: value for key, value in vars(args).items() if not callable(value)}
    results: dict[str, Any] = {"machine": report.machine(), "gpu": torch.cuda.get_device_name(), "settings": options | {
        "layers": config["num_hidden_layers"], "max_model_len": max_model_len}}

    def publish(section: str, rows: Any) -> None:
        results[section] = rows
        if args.json is not None:
            report.write_json(args.json, results)

    llm = _engine(settings, "continuous")
    num_blocks, block_size = llm.engine.kv.num_blocks, llm.engine.kv.block_size
    results["settings"]["num_kv_blocks"] = num_blocks
    continuous = {kind: _timed_workload(llm, w) for kind, w in workloads.items()}
    measured = {}
    for rate in rates:
        llm.engine.kv.reset_prefix_cache()
        measured[rate] = summarize_latency(replay_at_rate(llm.engine, traffic[rate]))
    publish("latency", [{"qps": rate, **asdict(measured[rate])} for rate in rates])
    _print_latency(results["latency"])
    generator = torch.Generator().manual_seed(args.seed)
    publish("decode", [_roofline_row(cost, batch, *timed_decode(llm.engine, batch, args.prompt_len, args.output_len,
                                                                generator), args.bandwidth_gbs * 1e9)
                       for batch in batches])
    _print_decode(results["decode"], args)
    llm.close()
    del llm  # its weights, KV cache and graphs go before the next engine loads
    _release_gpu()

    llm = _engine(settings, "static")
    static = {kind: _timed_workload(llm, w) for kind, w in workloads.items()}
    llm.close()
    del llm
    _release_gpu()
    waste = {kind: kv_waste(w, num_blocks, block_size, args.max_num_seqs, args.max_num_batched_tokens)
             for kind, w in workloads.items()}
    publish("workloads", [{"workload": kind, "requests": len(w.requests), "output_tokens": w.num_output_tokens,
                           "continuous_s": continuous[kind], "static_s": static[kind],
                           "continuous_tok_s": w.num_output_tokens / continuous[kind],
                           "static_tok_s": w.num_output_tokens / static[kind],
                           "continuous_over_static": speedup(continuous[kind], static[kind]),
                           "kv_waste_peak": waste[kind].peak_fraction, "kv_waste_mean": waste[kind].mean_fraction}
                          for kind, w in workloads.items()])
    _print_workloads(results["workloads"])

    start = time.perf_counter()
    calibration = calibrate(checkpoint, device="cuda", dtype="bfloat16", block_size=block_size,
                            max_num_batched_tokens=args.max_num_batched_tokens, cuda_graphs=True)
    print(f"calibrated in {time.perf_counter() - start:.0f} s ({len(calibration.steps)} timed steps)\n", flush=True)
    limits = EngineLimits(num_blocks, block_size, args.max_num_seqs, args.max_num_batched_tokens)
    clock: Callable[[StepShape], float] = lambda shape: calibration.model.seconds(cost, shape)
    results["calibration"] = calibration.model.to_json()
    publish("plan", [_plan_row(rate, measured[rate], replay(traffic[rate], limits, clock)) for rate in rates])
    _print_plan(results["plan"], results["calibration"])
    if args.json is not None:
        print(f"wrote {args.json}")


def _copies(kind: str, scale: str, seed: int, vocab_size: int, copies: int) -> Workload:
    """The workload of ``copies`` consecutive seeds, as one."""
    parts = [make_workload(kind, scale, seed + copy, vocab_size) for copy in range(copies)]
    return Workload(kind, scale, seed, vocab_size, tuple(r for part in parts for r in part.requests))


def _engine(settings: dict[str, Any], scheduling: str) -> LLM:
    start = time.perf_counter()
    llm = LLM(**settings, scheduling=scheduling)
    # The first prefill and mixed shapes compile Triton kernels; no timed run should pay for that.
    warm = make_workload("long-tail", "tiny", 1, llm.engine.model.vocab_size)
    _timed_workload(llm, warm)
    print(f"{scheduling} engine ready in {time.perf_counter() - start:.1f} s "
          f"({llm.engine.kv.num_blocks} KV blocks)", flush=True)
    return llm


def _timed_workload(llm: LLM, workload: Workload) -> float:
    """Seconds to finish every request of the workload, submitted at once, starting with an empty prefix cache."""
    llm.engine.kv.reset_prefix_cache()
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload.requests]
    start = time.perf_counter()
    llm.generate(prompts, [pagedllm_params(r) for r in workload.requests])
    return time.perf_counter() - start


def _release_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _roofline_row(cost: ModelCost, batch: int, tokens_per_s: float, context: float,
                  bandwidth: float) -> dict[str, Any]:
    roofline = roofline_tokens_per_s(cost, batch, context, bandwidth)
    return {"batch": batch, "mean_context": context, "tokens_per_s": tokens_per_s, "roofline_tokens_per_s": roofline,
            "of_roofline": tokens_per_s / roofline}


def _plan_row(rate: float, measured: Any, predicted: Any) -> dict[str, Any]:
    return {"qps": rate, "predicted_wall_s": predicted.predicted_wall_s, "measured_wall_s": measured.wall_s,
            "wall_error": predicted.predicted_wall_s / measured.wall_s - 1,
            "predicted_ttft_p99_s": predicted.ttft(99), "measured_ttft_p99_s": measured.ttft_p99_s,
            "predicted_tpot_p99_s": predicted.tpot(99), "measured_tpot_p99_s": measured.tpot_p99_s}


def _print_workloads(rows: list[dict[str, Any]]) -> None:
    print("\n## Workloads, all requests at once: continuous vs static batching\n")
    print(report.markdown_table(
        ("workload", "requests", "continuous tok/s", "static tok/s", "continuous / static", "KV waste peak / mean"),
        [(r["workload"], r["requests"], r["continuous_tok_s"], r["static_tok_s"], f"{r['continuous_over_static']:.2f}x",
          f"{r['kv_waste_peak']:.1%} / {r['kv_waste_mean']:.1%}") for r in rows]))
    best = max(r["continuous_over_static"] for r in rows)
    print(f"best continuous / static: {best:.2f}x (the seed claimed up to {SEED_CLAIM:g}x)\n", flush=True)


def _print_latency(rows: list[dict[str, Any]]) -> None:
    print("\n## long-tail arriving at a rate (Poisson)\n")
    print(report.markdown_table(
        ("qps", "tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms"),
        [(r["qps"], r["output_tokens_per_s"], r["ttft_p50_s"], r["ttft_p99_s"], _ms(r["tpot_p50_s"]),
          _ms(r["tpot_p99_s"])) for r in rows]), flush=True)


def _print_decode(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"## Decode against the roofline ({args.bandwidth_gbs:g} GB/s; prompt {args.prompt_len}, "
          f"output {args.output_len})\n")
    print(report.markdown_table(
        ("batch", "decode tok/s", "roofline tok/s", "of roofline", f"target >= {ROOFLINE_TARGET:.0%} (batch >= 64)"),
        [(r["batch"], r["tokens_per_s"], r["roofline_tokens_per_s"], f"{r['of_roofline']:.1%}",
          ("met" if r["of_roofline"] >= ROOFLINE_TARGET else "MISSED") if r["batch"] >= 64 else "–")
         for r in rows]), flush=True)


def _print_plan(rows: list[dict[str, Any]], calibration: dict[str, Any]) -> None:
    print(f"## pagedllm plan (calibrated here: {calibration['source']}) against the measured runs\n")
    print(report.markdown_table(
        ("qps", "predicted wall s", "measured wall s", "error", f"within ±{PLAN_TOLERANCE:.0%}",
         "TTFT p99 s predicted / measured", "TPOT p99 ms predicted / measured"),
        [(r["qps"], r["predicted_wall_s"], r["measured_wall_s"], f"{r['wall_error']:+.1%}",
          "met" if abs(r["wall_error"]) <= PLAN_TOLERANCE else "MISSED",
          f"{r['predicted_ttft_p99_s'] or 0:.3f} / {r['measured_ttft_p99_s']:.3f}",
          f"{_ms(r['predicted_tpot_p99_s'])} / {_ms(r['measured_tpot_p99_s'])}") for r in rows]), flush=True)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1e3 * seconds:.2f}"


def _numbers(text: str, kind: type, flag: str) -> list[Any]:
    try:
        values = [kind(item) for item in text.split(",") if item]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"{flag}={text!r} is invalid: expected comma-separated positive numbers")
    return values
