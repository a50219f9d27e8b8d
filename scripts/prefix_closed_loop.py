"""The prefix_repetition serving shape replayed in-process: ``--streams`` requests kept in flight on one engine.

``--num-prefixes`` shared ``--prefix-len``-token prefixes, ``--suffix-len``-token suffixes, ``--output-len``
tokens out (the shape of vLLM's ``prefix_repetition`` dataset, as ``pagedllm bench serving --client vllm
--dataset prefix_repetition`` sends it), without the serving stack. A finished request is replaced at the
next step, as a closed-loop client's would be. Prints the engine's step times, TTFT and end-to-end time
counted from ``add_request``, the prefix-cache hit rate and the prompt tokens computed.

    OMP_NUM_THREADS=1 .venv/bin/python -P scripts/prefix_closed_loop.py --arch qwen3
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm.core.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm_bench.models import bench_model


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    made = [prefix + [rng.randrange(vocab) for _ in range(args.suffix_len)]
            for prefix in prefixes for _ in range(args.num_prompts // args.num_prefixes)]
    rng.shuffle(made)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    settings = {"model": str(bench_model("tiny", args.arch)), "dtype": "float32", "device": "cpu", "block_size": 16,
                "max_model_len": 1024, "max_num_seqs": 64, "seed": args.seed}
    settings.update(item.split("=", 1) for item in args.engine_arg)
    engine = LLMEngine(EngineConfig.from_dict(settings))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    engine.add_request("warm-up", [1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    queued = prompts(args, min(2048, engine.model.vocab_size))
    sent: dict[str, float] = {}
    first_pending: set[str] = set()
    ttft: list[float] = []
    e2e: list[float] = []
    steps: list[float] = []
    queried, hits = engine.kv.prefix_queried_tokens, engine.kv.prefix_hit_tokens
    started = time.perf_counter()
    while queued or engine.has_unfinished_requests():
        while queued and len(sent) < args.streams:
            request_id = str(len(queued))
            engine.add_request(request_id, queued.pop(), params)
            sent[request_id] = time.perf_counter()
            first_pending.add(request_id)
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append(now - before)
        for output in outputs:
            if output.request_id in first_pending:
                first_pending.discard(output.request_id)
                ttft.append(now - sent[output.request_id])
            if output.finished:
                e2e.append(now - sent.pop(output.request_id))
    elapsed = time.perf_counter() - started
    ms = sorted(1e3 * s for s in steps)
    print(f"{args.num_prompts} requests in {elapsed:.2f} s, {len(steps)} steps: step p50 {ms[len(ms) // 2]:.2f} ms, "
          f"p90 {ms[int(0.9 * len(ms))]:.2f}, max {ms[-1]:.1f}")
    print(f"TTFT p50 {1e3 * statistics.median(ttft):.1f} ms, e2e p50 {1e3 * statistics.median(e2e):.1f} ms, "
          f"output tok/s {args.num_prompts * args.output_len / elapsed:.0f}")
    q, h = engine.kv.prefix_queried_tokens - queried, engine.kv.prefix_hit_tokens - hits
    print(f"prefix-cache hits {100 * h / q:.1f}% ({h} of {q} prompt tokens), computed {q - h}")


if __name__ == "__main__":
    main()
