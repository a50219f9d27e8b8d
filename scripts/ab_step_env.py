"""Two engines in one process, built under two environments, timed step by step in turns.

    OMP_NUM_THREADS=1 python scripts/ab_step_env.py --model qwen2.5-0.5b --dtype bfloat16 \
        --a PAGEDLLM_CPU_LINEAR=mkl --b PAGEDLLM_CPU_LINEAR=mkl-packed

Each engine is loaded with its switches set (the compiled-routine caches are cleared between the
two loads, so each reads its own), gets the same ``--batch`` greedy requests, and then the two
alternate: one decode step of A, one of B, ``--steps`` times; then prefill steps of
``--prompt-len`` tokens in turns. A slow spell of a shared host lands on both alike. Prints the
medians, the B/A speed-up, and whether both produced the same tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm_bench.models import bench_model
from pagedllm.layers import cpu_fused_ops
from pagedllm.attention import native_decode, native_prefill


def _load(model: str, dtype: str, switches: list[str], batch: int, max_len: int) -> LLM:
    saved = dict(os.environ)
    try:
        for switch in switches:
            name, _, value = switch.partition("=")
            os.environ[name] = value
        for cached in (native_decode.load_native_decode, native_prefill.load_native_prefill, cpu_fused_ops._load):
            cached.cache_clear()
        return LLM(str(bench_model(model)), dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=2048,
                   max_model_len=max_len, enable_prefix_caching=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _timed_step(engine: Any) -> float:
    started = time.perf_counter()
    engine.step()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--a", nargs="*", default=[], help="NAME=VALUE switches of engine A")
    parser.add_argument("--b", nargs="*", default=[], help="NAME=VALUE switches of engine B")
    parser.add_argument("--dtype-b", default=None, help="engine B's dtype, when it differs")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prefills", type=int, default=3)
    args = parser.parse_args()
    max_len = max(args.context, args.prompt_len) + args.steps + 16
    engines = {"A": _load(args.model, args.dtype, args.a, args.batch, max_len),
               "B": _load(args.model, args.dtype_b or args.dtype, args.b, args.batch, max_len)}
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (args.context,), generator=generator).tolist() for _ in range(args.batch)]
    long_prompt = torch.randint(3, 2000, (args.prompt_len,), generator=generator).tolist()
    greedy = SamplingParams(max_tokens=args.steps + 3, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    decode: dict[str, list[float]] = {"A": [], "B": []}
    prefill: dict[str, list[float]] = {"A": [], "B": []}
    for name, llm in engines.items():
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"d{i}", prompt, greedy)
        llm.engine.step()
        llm.engine.step()
    for _ in range(args.steps):
        for name, llm in engines.items():
            decode[name].append(_timed_step(llm.engine))
    for name, llm in engines.items():
        outputs = []
        while llm.engine.has_unfinished_requests():
            outputs += [o for o in llm.engine.step() if o.finished]
        tokens[name] = [o.outputs[0].token_ids for o in sorted(outputs, key=lambda o: o.request_id)]
    for i in range(args.prefills + 1):
        for name, llm in engines.items():
            llm.engine.add_request(f"p{i}", long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
            took = _timed_step(llm.engine)
            if i:  # the first warms the prefill path
                prefill[name].append(took)
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s); A={args.a} B={args.b}")
    for label, table in ((f"decode step, batch {args.batch}", decode), (f"prefill step, {args.prompt_len} tokens",
                                                                        prefill)):
        a, b = statistics.median(table["A"]), statistics.median(table["B"])
        print(f"{label}: A {a:.1f} ms, B {b:.1f} ms (median of {len(table['A'])}); B is {a / b:.2f}x A's speed")
    same = tokens["A"] == tokens["B"]
    print(f"greedy tokens of the decode batch: {'identical' if same else 'DIFFER'}")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
