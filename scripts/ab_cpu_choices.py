"""Side-by-side evidence for the CPU step path's choices, each A/B interleaved in one process, 1 thread.

1. Head-major cache: SDPA over gathered keys whose (sequence, KV head) rows are contiguous, as
   ``new_cpu_cache`` gives, against keys strided by the heads, as the usual layout gives.
2. Shared-prefix (cascade) decode attention on and off (``MIN_SHARED_PREFIX_BLOCKS``), on the tiny
   model's throughput workloads, with a digest of every token list to show the outputs are the same.
3. The sampled token's logprob: one fused ``log_softmax`` (the sampler's) against ``gather - logsumexp``.
4. Linears: ``F.linear`` (MKL, the default) against oneDNN's prepacked fp32 linear (not used: it
   rounds differently from transformers, whose greedy tokens the tests match exactly).
5. Huge pages: a decode step's attention (the compiled routine) over a cache from ``new_cpu_cache``,
   which asks for transparent huge pages, against the same layout on 4 KB pages; blocks scattered in
   a 128 MB cache, the CPU caches flushed before every call as a layer's linears flush them.

Usage: .venv/bin/python scripts/ab_cpu_choices.py [--rounds 2] [--only huge-pages]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import pagedllm.attention.cpu_attention_plan as cpu_plan
from pagedllm import LLM
from pagedllm_bench.engines import pagedllm_params
from pagedllm_bench.models import bench_model
from pagedllm.simulation.workloads import make_workload
from pagedllm.attention.backends import torch_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.cpu_attention import new_cpu_cache


def seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def sdpa_layouts(rounds: int) -> None:
    print("| decode batch (2 KV heads x 2 queries, head_dim 64) | head-strided us | head-major us | speed-up |")
    print("|---|---|---|---|")
    for num_seqs, context in ((32, 256), (32, 512), (64, 1024)):
        q = torch.randn(num_seqs, 2, 2, 64)
        strided = [torch.randn(num_seqs, context, 2, 64).transpose(1, 2) for _ in range(2)]
        head_major = [torch.randn(2, num_seqs, context, 64).transpose(0, 1) for _ in range(2)]
        times: dict[str, list[float]] = {"strided": [], "head-major": []}
        for _ in range(rounds):
            for name, (k, v) in (("strided", strided), ("head-major", head_major)):
                times[name].append(seconds(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125), 50))
        a, b = min(times["strided"]), min(times["head-major"])
        print(f"| {num_seqs} x ctx {context} | {1e6 * a:.0f} | {1e6 * b:.0f} | {a / b:.2f}x |")


def cascade(rounds: int) -> None:
    print("\n| tiny workload | cascade off s | cascade on s | speed-up | same tokens |\n|---|---|---|---|---|")
    default = cpu_plan.MIN_SHARED_PREFIX_BLOCKS
    for kind in ("shared-prefix", "branching-chat", "parallel-sampling"):
        workload = make_workload(kind, "full", vocab_size=2048)
        llm = LLM(model=str(bench_model("tiny")), dtype="float32", max_num_seqs=32, max_num_batched_tokens=2048,
                  seed=workload.seed)
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload.requests]
        params = [pagedllm_params(r) for r in workload.requests]
        times: dict[str, list[float]] = {"off": [], "on": []}
        digests: dict[str, set[str]] = {"off": set(), "on": set()}
        for _ in range(rounds):
            for name, threshold in (("off", 1 << 30), ("on", default)):
                cpu_plan.MIN_SHARED_PREFIX_BLOCKS = threshold
                llm.engine.kv.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                times[name].append(time.perf_counter() - start)
                tokens = [[list(o.token_ids) for o in out.outputs] for out in outputs]
                digests[name].add(hashlib.sha1(repr(tokens).encode()).hexdigest())
        cpu_plan.MIN_SHARED_PREFIX_BLOCKS = default
        off, on = min(times["off"]), min(times["on"])
        same = "yes" if digests["off"] == digests["on"] and len(digests["on"]) == 1 else "no"
        print(f"| {kind} | {off:.2f} | {on:.2f} | {off / on:.2f}x | {same} |")


def logprob(rounds: int) -> None:
    print("\n| logits | gather - logsumexp us | log_softmax + gather us | speed-up | max difference |")
    print("|---|---|---|---|---|")
    for rows, vocab in ((64, 2048), (256, 2048), (256, 32000)):
        raw = torch.randn(rows, vocab)
        chosen = raw.argmax(dim=-1, keepdim=True)
        variants = {"lse": lambda: raw.gather(1, chosen) - raw.logsumexp(dim=-1, keepdim=True),
                    "fused": lambda: raw.log_softmax(dim=-1).gather(1, chosen)}
        times = {name: min(seconds(fn, 50) for _ in range(rounds)) for name, fn in variants.items()}
        difference = float((variants["lse"]() - variants["fused"]()).abs().max())
        print(f"| {rows} x {vocab} | {1e6 * times['lse']:.0f} | {1e6 * times['fused']:.0f} | "
              f"{times['lse'] / times['fused']:.2f}x | {difference:.1e} |")


def linears(rounds: int) -> None:
    print("\n| rows x in x out (fp32) | F.linear us | oneDNN prepacked us | speed-up |\n|---|---|---|---|")
    for rows, d_in, d_out in ((32, 256, 1024), (32, 256, 2048), (2048, 256, 1024), (2048, 512, 256)):
        x, weight = torch.randn(rows, d_in), torch.randn(d_out, d_in)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=rows)
        variants = {"mkl": lambda: F.linear(x, weight),
                    "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
        times = {name: min(seconds(fn, 20) for _ in range(rounds)) for name, fn in variants.items()}
        print(f"| {rows} x {d_in} x {d_out} | {1e6 * times['mkl']:.0f} | {1e6 * times['onednn']:.0f} | "
              f"{times['mkl'] / times['onednn']:.2f}x |")


def huge_pages(rounds: int) -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"\n(transparent huge pages: {mode.read_text().strip() if mode.exists() else 'none'})")
    print("| decode step, small heads 8/2, head_dim 64 | 4 KB pages ms | huge pages ms | speed-up |\n|---|---|---|---|")
    num_blocks, block_size, kv_heads, head_dim = 16384, 16, 2, 64  # 128 MB per cache
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # Same head-major layout; the plain one comes from torch.zeros, which asks the kernel for nothing.
    caches = {"4k": [torch.zeros(kv_heads, num_blocks, block_size, head_dim).permute(1, 2, 0, 3).normal_()
                     for _ in range(2)],
              "huge": [new_cpu_cache(shape, torch.float32, torch.device("cpu")).normal_() for _ in range(2)]}
    backend = torch_backend()
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(0)
    for num_seqs, context in ((2, 450), (8, 600), (32, 600)):
        per_seq = -(-context // block_size)
        table = torch.randperm(num_blocks, generator=generator)[: num_seqs * per_seq].view(num_seqs, per_seq)
        metadata = backend.plan(AttentionMetadata(
            torch.arange(num_seqs + 1, dtype=torch.int32), torch.full((num_seqs,), context, dtype=torch.int32),
            table.to(torch.int32), torch.zeros(num_seqs, dtype=torch.int64), 1, context))
        q = torch.randn(num_seqs, 8, head_dim)
        times: dict[str, list[float]] = {"4k": [], "huge": []}
        for _ in range(15 * rounds):
            for name, (k, v) in caches.items():
                flush.add_(1)
                start = time.perf_counter()
                backend.attend(q, k, v, metadata, head_dim**-0.5)
                times[name].append(time.perf_counter() - start)
        a, b = statistics.median(times["4k"]), statistics.median(times["huge"])
        print(f"| {num_seqs} x ctx {context} | {1e3 * a:.3f} | {1e3 * b:.3f} | {a / b:.2f}x |")


SECTIONS: dict[str, Callable[[int], None]] = {"sdpa-layouts": sdpa_layouts, "cascade": cascade, "logprob": logprob,
                                              "linears": linears, "huge-pages": huge_pages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run this section alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, section in SECTIONS.items():
        if args.only in (None, name):
            section(args.rounds)


if __name__ == "__main__":
    main()
