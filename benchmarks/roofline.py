"""Memory bandwidth (a STREAM-like probe) and the share of it a decode step reaches, per size and dtype.

A decode step at a small batch reads every weight once and does little else,
so its floor is ``weight bytes / memory bandwidth``. This bench measures both
sides on this host, with the engine's own thread count:

- the probe times STREAM's four kernels (copy, scale, add, triad) and a
  read-only pass (a sum) over arrays far larger than the last-level cache,
  best of ``--probe-repeats``, counting the bytes STREAM counts;
- the decode step is the median wall time of ``--steps`` engine steps while
  ``batch`` greedy requests decode together (prompts already prefilled);
- the bytes per step are the checkpoint's weights in the run's dtype, the
  input embedding left out (a step reads a few rows of it) and a tied head
  counted once. For a mixture of experts only the experts a step can touch
  are counted: with ``E`` experts, top-``k`` and ``b`` rows, the expected
  distinct experts per layer under uniform routing, ``E (1 - (1 - k/E)^b)``.

The share is ``bytes / step time / read bandwidth``: the read-only pass is
the traffic a decode step makes, and the highest of the probe's rates, so the
share is never flattered.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm_bench import report
from pagedllm_bench.models import SIZE_NAMES, bench_model

PROBES = ("copy", "scale", "add", "triad", "read")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="qwen2.5-0.5b", help="comma-separated: " + ", ".join(SIZE_NAMES))
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16, float32")
    parser.add_argument("--batches", default="1,16", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens of each request's prompt")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per cell")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the probe and the engine")
    parser.add_argument("--probe-mib", type=int, default=512, help="size of each probe array (>> last-level cache)")
    parser.add_argument("--probe-repeats", type=int, default=5)
    parser.add_argument("--probe-only", action="store_true", help="measure the bandwidth and stop")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> int:
    report.set_threads(args.threads)
    info = report.machine()
    print(report.header("pagedllm bench roofline", info))
    bandwidth = memory_bandwidth(args.probe_mib, args.probe_repeats)
    print(report.markdown_table(["STREAM-like probe", "GB/s"], [[name, f"{bandwidth[name]:.2f}"] for name in PROBES]))
    rows: list[dict[str, Any]] = []
    if not args.probe_only:
        for model in _split(args.models, SIZE_NAMES):
            for dtype in _split(args.dtypes, ("bfloat16", "float32")):
                rows += decode_roofline(model, dtype, [int(b) for b in args.batches.split(",")], args, bandwidth)
        print(report.markdown_table(
            ["model", "dtype", "batch", "weight MB read/step", "step ms (median)", "GB/s reached",
             "share of read bandwidth"],
            [[r["model"], r["dtype"], r["batch"], f"{r['weight_bytes'] / 1e6:.0f}", f"{r['step_ms']:.1f}",
              f"{r['reached_gbs']:.2f}", f"{100 * r['share']:.0f}%"] for r in rows]))
    path = report.write_json(args.out / "roofline.json", {"machine": info, "bandwidth_gbs": bandwidth, "rows": rows})
    print(f"wrote {path}")
    return 0


def memory_bandwidth(mib: int, repeats: int) -> dict[str, float]:
    """GB/s of each STREAM kernel over float32 arrays of ``mib`` MiB, best of ``repeats`` (STREAM's rule)."""
    n = mib * 2**20 // 4
    a, b, c = (torch.full((n,), value, dtype=torch.float32) for value in (1.0, 2.0, 0.5))
    scalar = 3.0
    kernels = {
        "copy": (lambda: c.copy_(a), 2),
        "scale": (lambda: torch.mul(c, scalar, out=b), 2),
        "add": (lambda: torch.add(a, b, out=c), 3),
        "triad": (lambda: torch.add(b, c, alpha=scalar, out=a), 3),
        "read": (lambda: a.sum(), 1),
    }
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(repeats):
        for name, (kernel, _) in kernels.items():
            started = time.perf_counter()
            kernel()
            best[name] = min(best[name], time.perf_counter() - started)
    return {name: arrays * n * 4 / best[name] / 1e9 for name, (_, arrays) in kernels.items()}


def weight_bytes_per_step(model_dir: Path, dtype: torch.dtype, batch: int) -> int:
    """Bytes of the weights one decode step of ``batch`` rows reads (see the module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    touched = 1.0 if not experts else (1 - (1 - top_k / experts) ** batch)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = 0.0
    for name, parameter in model.named_parameters():  # a tied head is one parameter, listed once
        if parameter is embedding and parameter is not head:
            continue
        share = touched if ".experts." in f"{name}." and "shared_expert" not in name else 1.0
        total += parameter.numel() * share
    return int(total * torch.finfo(dtype).bits // 8)


def decode_roofline(model: str, dtype: str, batches: list[int], args: argparse.Namespace,
                    bandwidth: dict[str, float]) -> list[dict[str, Any]]:
    from pagedllm import LLM, SamplingParams

    model_dir = bench_model(model)
    torch_dtype = getattr(torch, dtype)
    rows = []
    with LLM(str(model_dir), dtype=dtype, max_num_seqs=max(batches), max_num_batched_tokens=2048,
             max_model_len=args.prompt_len + args.steps + 16, enable_prefix_caching=False) as llm:
        engine = llm.engine
        generator = torch.Generator().manual_seed(0)
        for batch in batches:
            greedy = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                prompt = torch.randint(3, 2000, (args.prompt_len,), generator=generator).tolist()
                engine.add_request(f"{dtype}-{batch}-{i}", prompt, greedy)
            while _prefilling(engine):
                engine.step()  # every prompt, in as many chunks as the token budget needs
            engine.step()  # the first decode step warms what the prefill did not
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - started)
            while engine.has_unfinished_requests():
                engine.step()
            step = statistics.median(times)
            weights = weight_bytes_per_step(model_dir, torch_dtype, batch)
            reached = weights / step / 1e9
            rows.append({"model": model, "dtype": dtype, "batch": batch, "weight_bytes": weights,
                         "step_ms": step * 1e3, "reached_gbs": reached, "share": reached / bandwidth["read"]})
            print(f"[{model} {dtype} b={batch}] {step * 1e3:.1f} ms/step", flush=True)
    return rows


def _prefilling(engine: Any) -> bool:
    scheduler = engine.scheduler
    return bool(scheduler.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running)


def _split(text: str, allowed: tuple[str, ...]) -> list[str]:
    items = [item for item in text.split(",") if item]
    bad = [item for item in items if item not in allowed]
    if bad or not items:
        raise ValueError(f"{text!r} is invalid: expected a comma-separated subset of {', '.join(allowed)}")
    return items
