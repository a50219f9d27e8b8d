"""Replicas behind vllm-router (round_robin, cache_aware, kv_aware) against one replica with their blocks combined.

Workload: a multi-tenant chat. Each user has a long system prompt of their own and a
conversation that grows turn by turn; every round, each user sends their next turn (the
whole history, then a new question), so a user's turn shares everything but its last
question with that user's previous turn, and users' turns arrive interleaved.

Setups, each started fresh (so every prefix-cache counter starts at zero): ``--replicas``
``pagedllm serve`` replicas of ``--blocks`` KV blocks each, publishing KV cache events,
behind ``vllm-router`` with each policy; and one replica of ``replicas x blocks`` blocks
with no router, the ideal a router can at best match. Measured per setup: the prefix-cache
hit rate (prompt tokens served from cache over prompt tokens queried, summed over the replicas'
own ``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total``), TTFT p50/p99
(first streamed token, as the client sees it) and output tokens per second.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from pagedllm_bench import report
from pagedllm.platform.processes import free_port

POLICIES = ("round_robin", "cache_aware", "kv_aware")
READY_LINE = "Ctrl-C stops the server"
WORDS = ("river stone lantern orbit meadow signal harbor copper violet engine thunder quiet ladder "
         "garden marble falcon silver winter ember canyon velvet anchor prism willow").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint (default: a tiny random one, built here)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=96, help="KV blocks per replica (the big one gets replicas x)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=120, help="length of each user's system prompt")
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


@dataclass(frozen=True, slots=True)
class Replica:
    process: subprocess.Popen[bytes]
    url: str
    metrics_url: str
    events: str
    replay: str

    def metric(self, name: str) -> float:
        for line in requests.get(self.metrics_url, timeout=10).text.splitlines():
            if line.startswith(name + "{") and 'model="llm"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def run(args: argparse.Namespace) -> None:
    router = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if router is None:
        raise SystemExit("vllm-router is not installed: pip install vllm-router==0.1.17")
    info = report.machine()
    print(report.header(f"{args.replicas} replicas behind vllm-router vs one replica with their blocks", info))
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-replicas-") as scratch:
        model = Path(args.model) if args.model else _tiny_model(Path(scratch))
        setups = [(policy, args.replicas, args.blocks) for policy in args.policies.split(",")]
        setups.append(("one replica", 1, args.replicas * args.blocks))
        results = []
        for name, count, blocks in setups:
            print(f"running {name} ({count} x {blocks} blocks)...", file=sys.stderr, flush=True)
            with ExitStack() as stack:
                fleet = stack.enter_context(_fleet(count, model, blocks, args, Path(scratch)))
                url = (fleet[0].url if count == 1
                       else stack.enter_context(_router(router, name, fleet, args.block_size)))
                results.append({"setup": name, "replicas": count, "blocks_each": blocks,
                                **_measure(url, fleet, args)})
    rows = [[r["setup"], f"{r['replicas']} x {r['blocks_each']}", f"{r['hit_rate']:.1%}",
             f"{r['ttft_p50_s'] * 1000:.0f}", f"{r['ttft_p99_s'] * 1000:.0f}", f"{r['output_tok_s']:.1f}",
             r["requests"]] for r in results]
    print(report.markdown_table(["setup", "KV blocks", "prefix hit rate", "TTFT p50 ms", "TTFT p99 ms",
                                 "output tok/s", "requests"], rows))
    path = report.write_json(args.out / "replicas.json", {"machine": info, "args": _jsonable(vars(args)),
                                                           "results": results})
    print(f"\nJSON: {path}")


def _measure(url: str, fleet: list[Replica], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    systems = [f"System for user {u}: " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for u in range(args.users)]
    histories = list(systems)
    ttfts: list[float] = []
    output_tokens = 0
    lock = threading.Lock()

    def turn(user: int, index: int) -> None:
        nonlocal output_tokens
        prompt = histories[user] + f"\nUser: question {index} of user {user}?\nAssistant:"
        first, text, tokens = _stream(url, prompt, args.reply_tokens)
        with lock:
            ttfts.append(first)
            output_tokens += tokens
            histories[user] = prompt + text

    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for index in range(args.turns):  # one round: every user's next turn, interleaved
            list(pool.map(lambda user: turn(user, index), range(args.users)))
    elapsed = time.perf_counter() - started
    time.sleep(0.5)  # the replicas' metrics publish just after their last step
    queries = [r.metric("vllm:prefix_cache_queries_total") for r in fleet]
    hits = [r.metric("vllm:prefix_cache_hits_total") for r in fleet]
    ttfts.sort()
    return {"hit_rate": sum(hits) / max(sum(queries), 1), "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            "output_tok_s": output_tokens / elapsed, "requests": len(ttfts), "wall_s": elapsed,
            "prefix_cache_queries_per_replica": queries, "prefix_cache_hits_per_replica": hits}


def _stream(url: str, prompt: str, max_tokens: int) -> tuple[float, str, int]:
    """(time to the first token, the reply, its token count) of one streamed completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first: float | None = None
    text, tokens = "", 0
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text") and first is None:
                    first = time.perf_counter() - started
                text += choice.get("text", "")
    return (first if first is not None else time.perf_counter() - started), text, tokens


@contextmanager
def _fleet(count: int, model: Path, blocks: int, args: argparse.Namespace, scratch: Path) -> Iterator[list[Replica]]:
    """``count`` replicas, started side by side; one that fails to start is started again on other ports."""
    started: list[tuple[Replica, Path]] = []
    pending: list[tuple[Replica, Path]] = []
    try:
        pending += [_start(model, blocks, args, scratch) for _ in range(count)]
        deadline = time.monotonic() + 900
        while pending:
            replica, log = pending.pop(0)
            if READY_LINE.encode() in log.read_bytes():
                started.append((replica, log))
            elif replica.process.poll() is not None:
                errors = [line for line in log.read_text(errors="replace").splitlines() if "rror" in line]
                print(f"a replica failed to start ({'; '.join(errors[-3:])[:500]}); starting it again",
                      file=sys.stderr, flush=True)
                pending.append(_start(model, blocks, args, scratch))
            else:
                pending.append((replica, log))
                time.sleep(0.5)
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not start within 15 minutes")
        yield [replica for replica, _ in started]
    finally:
        for replica, _ in started + pending:
            _stop(replica.process)


def _start(model: Path, blocks: int, args: argparse.Namespace, scratch: Path) -> tuple[Replica, Path]:
    grpc, http, metrics, port, events, replay = (free_port() for _ in range(6))
    kv_events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
                            "replay_endpoint": f"tcp://*:{replay}"})
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(model), "--served-model-name", "bench",
               "--engine-arg", f"num_kv_blocks={blocks}", "--engine-arg", f"block_size={args.block_size}",
               "--engine-arg", f"max_model_len={args.max_model_len}", "--engine-arg", "cpu_bind=off",
               "--kv-events-config", kv_events, "--host", "127.0.0.1", "--grpc-port", str(grpc),
               "--http-port", str(http), "--metrics-port", str(metrics), "--openai-port", str(port)]
    log = scratch / f"replica-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=scratch)
    return Replica(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics",
                   f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"), log


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def _router(binary: str, policy: str, fleet: list[Replica], block_size: int) -> Iterator[str]:
    port = free_port()
    command = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--log-level", "warning",
               "--worker-urls", *(r.url for r in fleet)]
    if policy == "kv_aware":
        for replica in fleet:
            command += ["--kv-event-source", f"{replica.url}={replica.events}",
                        "--kv-event-replay-source", f"{replica.url}={replica.replay}"]
        command += ["--kv-event-block-size", str(block_size), "--kv-event-model", "bench"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router --policy {policy} did not start")
            time.sleep(0.3)
        time.sleep(1.0)  # kv_aware: its event subscriptions in place before the first request
        yield url
    finally:
        process.terminate()
        process.wait(30)


def _tiny_model(scratch: Path) -> Path:
    from pagedllm.testing.tiny_model import make_tiny_model

    return make_tiny_model(scratch / "tiny-llama")


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {key: str(value) if isinstance(value, Path) else value for key, value in values.items()}
