"""Speculative decoding on CUDA: greedy tokens with and without speculation, and time per token at batch 1.

For each proposer (n-gram, and the draft shipped beside the embedded model) the embedded model decodes the
`pagedllm bench spec` workloads one request at a time, on CUDA with the Triton kernels, CUDA graphs off and
on. Greedy tokens with speculation must equal those without (exit 1 otherwise). Verification steps (k + 1
positions per request) run eagerly: graphs are captured for one-token decode steps only, so the plain
engine's graphs and the speculative engine's eager verification are what this compares.
"""
import json
import os
import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm_bench.spec import workloads

PROMPTS = 4
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
proposers = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
             "draft_model": {"method": "draft_model", "num_speculative_tokens": 4}}
failures = 0
rows = []


def per_token(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Each prompt alone (concurrency 1): ms per output token over all of them, prefill included, and tokens."""
    tokens, started = [], time.perf_counter()
    for prompt in prompts:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        tokens.append(list(out.outputs[0].token_ids))
    return (time.perf_counter() - started) * 1e3 / sum(len(t) for t in tokens), tokens


for graphs in (False, True):
    common = {"device": "cuda", "attention_backend": "triton", "dtype": "float32", "cuda_graphs": graphs,
              "max_num_seqs": 8, "enable_prefix_caching": False}
    plain = LLM(**common)
    prompts = workloads(plain, PROMPTS)
    per_token(plain, prompts["free"][:1])  # compiles the kernels and captures outside the timing
    for method, config in proposers.items():
        spec = LLM(speculative_config=config, **common)
        per_token(spec, prompts["free"][:1])
        for workload, batch in prompts.items():
            ms_without, want = per_token(plain, batch)
            ms_with, got = per_token(spec, batch)
            same = sum(a == b for a, b in zip(want, got))
            failures += same != len(batch)
            rows.append({"graphs": graphs, "method": method, "workload": workload, "ms_per_token_without": ms_without,
                         "ms_per_token_with": ms_with, "ratio": ms_with / ms_without, "identical": same})
            print(f"graphs {'on ' if graphs else 'off'} {method:11} {workload:8} ms/token without {ms_without:7.2f} "
                  f"with {ms_with:7.2f} ratio {ms_with / ms_without:.3f}  greedy identical {same}/{len(batch)}")
        del spec
    del plain
out = Path(os.environ.get("OUT", "gpu-results"))
out.mkdir(parents=True, exist_ok=True)
(out / "spec_check.json").write_text(json.dumps(rows, indent=1))
sys.exit(1 if failures else 0)
