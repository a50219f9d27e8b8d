"""Where a speculative step's time goes at one stream: each forward by model and query length, and the host
work around them, against the same prompts decoded without speculation.

    python scripts/profile_spec_step.py [--method draft_model] [--num-speculative-tokens 2] [--workload copying]
                                        [--draft-confidence-threshold T] [--cpu-time]

The engines alternate prompt by prompt in one process (the bench's ``copying`` or ``free`` workload,
float32, 64 greedy tokens each, one torch thread). Functions are wrapped, not sampled: each call's time
is taken around it, so there is no profiler overhead inside the forwards. ``--cpu-time`` counts this
thread's CPU time instead of wall time, which a busy shared host disturbs less (a descheduled thread
stops counting; cache and memory contention still show). Forwards print their median and 20th percentile
per call by (model, tokens in the forward); host functions their total and mean per call.
"""
from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import llm_engine, speculative
from pagedllm.engine.llm import LLM
from pagedllm.worker import draft_proposer, input_batch, model_runner, ngram_proposer
from pagedllm_bench.spec import workloads

# Host work a step does besides forwards: (class, method) pairs wrapped and summed.
HOST_WORK = [
    (input_batch.InputBatch, "prepare"),
    (speculative.SpeculativeDecoding, "verify"),
    (speculative.SpeculativeDecoding, "propose"),
    (ngram_proposer.NgramProposer, "propose"),
    (draft_proposer.DraftProposer, "_draw"),
    (llm_engine.LLMEngine, "_sample_step"),
    (llm_engine.LLMEngine, "_emit_runs"),
    (llm_engine.LLMEngine, "step"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="draft_model")
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--draft-confidence-threshold", type=float, default=None)
    parser.add_argument("--workload", choices=("copying", "free"), default="copying")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    forwards: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    host: dict[tuple[str, str], list[float]] = collections.defaultdict(list)

    original_run = model_runner.ModelRunner.run

    def run(self: model_runner.ModelRunner, inputs: Any, copies: Any) -> Any:
        start = clock()
        result = original_run(self, inputs, copies)
        forwards[(getattr(self, "label", "?"), inputs.input_ids.numel())].append(clock() - start)
        return result

    model_runner.ModelRunner.run = run  # type: ignore[method-assign]
    for owner, name in HOST_WORK:
        setattr(owner, name, _timed(getattr(owner, name), host[(owner.__name__, name)], clock))

    config: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=4)
    elif args.draft_confidence_threshold is not None:
        config["draft_confidence_threshold"] = args.draft_confidence_threshold
    common: dict[str, Any] = {"max_num_seqs": 1, "enable_prefix_caching": False, "dtype": "float32"}
    plain, spec = LLM(None, **common), LLM(None, speculative_config=config, **common)
    plain.engine.runner.label = "plain"  # type: ignore[attr-defined]
    spec.engine.runner.label = "target"  # type: ignore[attr-defined]
    if spec.engine.speculative is not None and spec.engine.speculative.draft is not None:
        spec.engine.speculative.draft.runner.label = "draft"  # type: ignore[attr-defined]
    prompts = workloads(plain, args.prompts)[args.workload]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for llm in (plain, spec):
        llm.generate([{"prompt_token_ids": prompts[0]}], params)  # untimed warm-up
    forwards.clear()
    for times in host.values():  # in place: the wrappers hold these lists
        times.clear()
    for prompt in prompts:
        for llm in (plain, spec):
            llm.generate([{"prompt_token_ids": prompt}], params)

    print(f"{args.method}, k={args.num_speculative_tokens}, {args.workload}, {'CPU' if args.cpu_time else 'wall'} time")
    print("forward (model, tokens): calls, median ms, p20 ms")
    for key in sorted(forwards):
        times = sorted(forwards[key])
        print(f"  {key}: {len(times)}, {1e3 * times[len(times) // 2]:.3f}, {1e3 * times[len(times) // 5]:.3f}")
    print("host work (function): calls, total ms, mean us per call")
    for (owner, name), times in sorted(host.items()):
        if times:
            print(f"  {owner}.{name}: {len(times)}, {1e3 * sum(times):.1f}, {1e6 * sum(times) / len(times):.1f}")


def _timed(function: Callable[..., Any], into: list[float], clock: Callable[[], float]) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        result = function(*args, **kwargs)
        into.append(clock() - start)
        return result
    return timed


if __name__ == "__main__":
    main()
