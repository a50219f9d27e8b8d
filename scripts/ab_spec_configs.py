"""Several speculative configs against plain decoding, side by side in one process, at one stream.

    python scripts/ab_spec_configs.py '{"k2_t0": {"method": "draft_model", "num_speculative_tokens": 2,
        "draft_confidence_threshold": 0}, "k2": {"method": "draft_model", "num_speculative_tokens": 2}}' [--runs 3]
        [--cpu-time]

The bench's two workloads (``pagedllm bench spec``: 8 prompts each, float32, 64 greedy tokens, one torch
thread); for every prompt each engine decodes it in turn, so a busy spell of a shared host hits every config
alike. ``--cpu-time`` sums this thread's CPU time instead of wall time (a descheduled thread stops counting).
Prints each config's median time over runs divided by plain decoding's, its mean acceptance length and its
drafted tokens per verification; raises if any config's greedy tokens differ from plain decoding's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.llm import LLM
from pagedllm_bench.spec import workloads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", help="JSON object: name -> speculative_config")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    common: dict[str, Any] = {"max_num_seqs": 1, "enable_prefix_caching": False, "dtype": "float32"}
    engines = {"plain": LLM(None, **common)}
    for name, config in json.loads(args.configs).items():
        engines[name] = LLM(None, speculative_config=config, **common)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for workload, prompts in workloads(engines["plain"], 8).items():
        for llm in engines.values():
            llm.generate([{"prompt_token_ids": prompts[0]}], warm)  # untimed: first use of the shapes
        before = {name: _counts(llm) for name, llm in engines.items()}
        spent: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.runs):
            total = dict.fromkeys(engines, 0.0)
            for prompt in prompts:
                want = None
                for name, llm in engines.items():
                    start = clock()
                    out = llm.generate([{"prompt_token_ids": prompt}], params)
                    total[name] += clock() - start
                    tokens = out[0].outputs[0].token_ids
                    want = tokens if want is None else want
                    if tokens != want:
                        raise RuntimeError(f"{name}: greedy tokens differ from plain decoding's on {workload}")
            for name in engines:
                spent[name].append(total[name])
        plain = statistics.median(spent["plain"])
        cells = [f"{workload}: plain {1e3 * plain / len(prompts) / 64:.2f} ms/token"]
        for name, llm in list(engines.items())[1:]:
            drafts, drafted, accepted = (now - then for now, then in zip(_counts(llm), before[name]))
            cells.append(f"{name} {statistics.median(spent[name]) / plain:.3f} "
                         f"(acceptance {1 + accepted / max(drafts, 1):.2f}, drafted {drafted / max(drafts, 1):.2f})")
        print("  ".join(cells), flush=True)


def _counts(llm: LLM) -> tuple[int, int, int]:
    counts = llm.engine.stats().spec_decode
    return (0, 0, 0) if counts is None else (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens)


if __name__ == "__main__":
    main()
