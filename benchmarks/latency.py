"""``pagedllm bench latency``: where one request's time goes, hop by hop, at concurrency 1.

Starts ``pagedllm serve --openai-port`` on the tiny checkpoint with
``PAGEDLLM_LATENCY_TRACE`` set (:mod:`pagedllm.engine.latency_trace`), so the OpenAI
door, the Triton stub and the engine core child time-stamp each request at their
hops on one clock. It then sends requests one at a time through both front doors
(OpenAI SSE, and tritonclient gRPC streaming) from this process, which stamps when
it sent each and when each streamed token arrived, and reports:

* the first token's path, hop by hop (median microseconds);
* every later token's path from the end of its engine step to the client, and the
  step period, against the same requests' step period run in-process
  (``LLMEngine`` in this process, one request at a time): the served TPOT minus the
  in-process TPOT is what serving costs each token;
* the CPU time each process spends per token (``/proc``), which a busy host inflates
  far less than it inflates latency.
"""
from __future__ import annotations

import argparse
import bisect
import http.client
import json
import os
import queue
import random
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from pagedllm_bench import report
from pagedllm_bench.models import bench_model
from pagedllm_bench.serving_vllm_client import SERVED_NAME, pagedllm_serve_command, serve_until_stopped
from pagedllm.engine.core_process import CHILD_MARKER
from pagedllm.platform.cpu_binding import pin_process
from pagedllm.engine.latency_trace import TRACE_ENV
from pagedllm.platform.processes import cpu_ticks, free_port

TRITON_MODEL = "llm"  # what `pagedllm serve --model` names the Triton model
# (from, to, what lies between): the first token's path through each door.
OPENAI_FIRST = (
    ("client.sent", "door.forwarded", "client -> door: HTTP, FastAPI, request model"),
    ("door.forwarded", "stub.received", "door -> stub: gRPC stream, tritonserver, stub IPC"),
    ("stub.received", "stub.submitted", "stub: parse, tokenize, admit, loop thread, pipe send"),
    ("stub.submitted", "core.admitted", "pipe -> engine core (waits for a running step)"),
    ("core.admitted", "core.stepped", "engine core: queue + prefill step + sample + detokenize"),
    ("core.stepped", "stub.output", "engine core -> stub: encode, pipe, decode, loop thread"),
    ("stub.output", "stub.sent", "stub: tensors, sender thread, response send"),
    ("stub.sent", "door.response", "stub -> door: tritonserver, gRPC, decode"),
    ("door.response", "door.chunk", "door: OpenAI chunk"),
    ("door.chunk", "client.received", "door -> client: JSON, SSE, HTTP"),
)
GRPC_FIRST = (
    ("client.sent", "stub.received", "client -> stub: gRPC stream, tritonserver, stub IPC"),
    *OPENAI_FIRST[2:7],
    ("stub.sent", "client.received", "stub -> client: tritonserver, gRPC"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=12, help="per front door, one at a time")
    parser.add_argument("--prompt-words", type=int, default=60,
                        help="random words \"w<n>\": about 4.5 tokens each with the tiny model's tokenizer")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra engine arguments for the server and the in-process run")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    info = report.machine()
    print(report.header("pagedllm bench latency", info))
    model_dir = bench_model("tiny")
    rng = random.Random(args.seed)
    prompts = [" ".join(f"w{rng.randrange(5000)}" for _ in range(args.prompt_words)) for _ in range(args.requests)]
    in_process = InProcess(model_dir, args.max_tokens, args.seed, args.engine_arg)
    doors = {"openai": _openai_request, "grpc": _grpc_request}
    results: dict[str, Any] = {door: {"client": [], "cpu_ticks": defaultdict(int)} for door in doors}
    with tempfile.TemporaryDirectory(prefix="pagedllm-latency-") as scratch:
        trace_dir = Path(scratch) / "trace"
        port = free_port()
        command, grpc_port = pagedllm_serve_command(model_dir, port, args.seed, args.engine_arg)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), TRACE_ENV: str(trace_dir)}
        with serve_until_stopped(command, env, port, Path(scratch) / "serve.log") as (base, server):
            processes = _serving_processes(server.pid)
            engine_cpus = frozenset(os.sched_getaffinity(processes["engine core"]))
            # Each prompt in turn through the engine in this process (on the served engine's CPUs) and through
            # each door, so that a slow spell of a shared host lands on all three.
            for prompt in prompts:
                in_process.request(prompt, engine_cpus)
                for door, send in doors.items():
                    before = _cpu_ticks(processes)
                    results[door]["client"].append(send(base, grpc_port, prompt, args.max_tokens))
                    for name, ticks in _ticks_delta(before, _cpu_ticks(processes)).items():
                        results[door]["cpu_ticks"][name] += ticks
        hops = _read_trace(trace_dir)
    results["in_process"] = in_process.summary()
    rows = _report(results, hops)
    path = report.write_json(args.out / "latency.json", {"machine": info, "args": vars(args) | {"out": None},
                                                         "rows": rows})
    print(f"\nwrote {path}")


def _openai_request(base: str, grpc_port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0.0})
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    sent = time.monotonic_ns()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    received = []
    for line in response:
        if line.startswith(b"data: {"):
            received.append(time.monotonic_ns())
    connection.close()
    return {"key": None, "sent": sent, "received": received}


def _grpc_request(base: str, grpc_port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
        item = grpcclient.InferInput(name, list(value.shape), dtype)
        item.set_data_from_numpy(value)
        return item

    sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([True]), "BOOL"),
              tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
              tensor("exclude_input_in_output", np.array([True]), "BOOL")]
    arrivals: queue.Queue[tuple[int, bool]] = queue.Queue()

    def on_response(result: Any, error: Any) -> None:
        final = error is not None or result.get_response().parameters["triton_final_response"].bool_param
        has_text = error is None and result.as_numpy("text_output") is not None
        arrivals.put((time.monotonic_ns() if has_text else 0, final))

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    client.start_stream(callback=on_response)
    key = uuid.uuid4().hex
    sent = time.monotonic_ns()
    client.async_stream_infer(TRITON_MODEL, inputs, request_id=key, enable_empty_final_response=True)
    received = []
    while True:
        arrived, final = arrivals.get(timeout=300)
        if arrived:
            received.append(arrived)
        if final:
            break
    client.stop_stream()
    client.close()
    return {"key": key, "sent": sent, "received": received}


def _read_trace(folder: Path) -> dict[str, dict[str, list[int]]]:
    """key -> hop -> its stamps in order."""
    hops: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for path in folder.glob("trace-*.tsv"):
        for line in path.read_text().splitlines():
            hop, key, ns = line.split("\t")
            hops[key][hop].append(int(ns))
    for stamps in hops.values():
        for values in stamps.values():
            values.sort()
    return hops


def _report(results: dict[str, Any], hops: dict[str, dict[str, list[int]]]) -> dict[str, Any]:
    # OpenAI requests carry the door's key, unknown to the client; they went one at a time, so each is the
    # one the door forwarded between its sending and its first token.
    forwarded = {key: stamps["door.forwarded"][0] for key, stamps in hops.items() if "door.forwarded" in stamps}
    for request in results["openai"]["client"]:
        request["key"] = next((key for key, at in forwarded.items()
                               if request["sent"] <= at <= request["received"][0]), None)
    rows: dict[str, Any] = {}
    for door, path in (("openai", OPENAI_FIRST), ("grpc", GRPC_FIRST)):
        timelines = []
        for request in results[door]["client"]:
            stamps = dict(hops.get(request["key"], {}))
            stamps["client.sent"], stamps["client.received"] = [request["sent"]], request["received"]
            timelines.append(stamps)
        rows[door] = _door_rows(door, path, timelines, results[door]["cpu_ticks"], results["in_process"])
    return rows


def _door_rows(door: str, path: tuple[tuple[str, str, str], ...], timelines: list[dict[str, list[int]]],
               ticks: dict[str, int], in_process: dict[str, float]) -> dict[str, Any]:
    first = [(a, b, what, _median_us([t[b][0] - t[a][0] for t in timelines if t.get(a) and t.get(b)]))
             for a, b, what in path]
    # Later tokens, from the end of their engine step to the client. Not every step makes a response (a
    # token whose text is held back makes none), so each stamp is paired with the latest stamp of the hop
    # before it: tokens are a step apart, far more than a hop takes.
    later = [(a, b, what, _median_us([gap for t in timelines for gap in _gaps(t.get(a, []), t.get(b, [])[1:])]))
             for a, b, what in path if _after_step(a, path)]
    served_tpot = _median_us([(t["client.received"][-1] - t["client.received"][0]) / (len(t["client.received"]) - 1)
                              for t in timelines if len(t["client.received"]) > 1])
    step_period = _median_us([(t["core.stepped"][-1] - t["core.stepped"][0]) / (len(t["core.stepped"]) - 1)
                              for t in timelines if len(t.get("core.stepped", ())) > 1])
    ttft = _median_us([t["client.received"][0] - t["client.sent"][0] for t in timelines])
    tokens = sum(len(t["client.received"]) for t in timelines)
    ms_per_token = {name: 1000 * count / os.sysconf("SC_CLK_TCK") / tokens for name, count in ticks.items()}
    title = "OpenAI /v1/completions, SSE" if door == "openai" else "tritonclient gRPC stream"
    print(f"\n## {title}: {len(timelines)} requests one at a time, {tokens} tokens\n")
    print(f"TTFT p50 {ttft / 1000:.2f} ms (in-process {in_process['ttft_us'] / 1000:.2f} ms); TPOT p50 "
          f"{served_tpot / 1000:.3f} ms, engine core step period {step_period / 1000:.3f} ms, in-process "
          f"{in_process['tpot_us'] / 1000:.3f} ms: serving adds {(served_tpot - in_process['tpot_us']) / 1000:+.3f} "
          f"ms per token\n")
    print(report.markdown_table(("first token: hop", "between", "median us"),
                                [[f"{a} -> {b}", what, f"{us:.0f}"] for a, b, what, us in first]))
    print()
    print(report.markdown_table(("later tokens: hop", "between", "median us"),
                                [[f"{a} -> {b}", what, f"{us:.0f}"] for a, b, what, us in later]))
    print()
    print(report.markdown_table(("process", "CPU ms per token"),
                                [[name, f"{value:.3f}"] for name, value in ms_per_token.items()]))
    return {"ttft_us": ttft, "tpot_us": served_tpot, "step_period_us": step_period,
            "in_process": in_process, "first": first, "later": later, "cpu_ms_per_token": ms_per_token,
            "requests": len(timelines), "tokens": tokens}


def _gaps(earlier: list[int], later: list[int]) -> list[int]:
    """For each stamp of ``later``, how long after the latest stamp of ``earlier`` before it it came."""
    gaps = []
    for stamp in later:
        index = bisect.bisect_right(earlier, stamp)
        if index:
            gaps.append(stamp - earlier[index - 1])
    return gaps


def _after_step(hop: str, path: tuple[tuple[str, str, str], ...]) -> bool:
    starts = [a for a, _, _ in path]
    return starts.index(hop) >= starts.index("core.stepped")


def _median_us(values_ns: list[float]) -> float:
    return statistics.median(values_ns) / 1000 if values_ns else float("nan")


def _serving_processes(launcher: int) -> dict[str, int]:
    """name -> pid of the launcher (OpenAI door), tritonserver, the backend stub and the engine core."""
    found = {"pagedllm serve (OpenAI door)": launcher, "this client": os.getpid()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"tritonserver " in command and b"--model-repository" in command:
            found["tritonserver"] = int(entry.name)
        elif b"triton_python_backend_stub" in command:
            found["backend stub"] = int(entry.name)
        elif CHILD_MARKER.encode() in command:
            found["engine core"] = int(entry.name)
    return found


def _cpu_ticks(processes: dict[str, int]) -> dict[str, int]:
    ticks = {}
    for name, pid in processes.items():
        ticks[name] = cpu_ticks(pid)
    return ticks


def _ticks_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in before}


class InProcess:
    """The same requests through an ``LLMEngine`` in this process, one at a time: TTFT and step period."""

    def __init__(self, model_dir: Path, max_tokens: int, seed: int, engine_args: list[str]) -> None:
        from pagedllm import LLM, SamplingParams
        from pagedllm.serving.cli import parse_engine_args

        llm = LLM(model=str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=1024,
                  max_num_seqs=64, seed=seed, **parse_engine_args(engine_args))
        llm.generate(["warm up"], SamplingParams(max_tokens=4))
        self._engine = llm.engine
        self._params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self._ttfts: list[int] = []
        self._periods: list[float] = []

    def request(self, prompt: str, cpus: frozenset[int]) -> None:
        before = frozenset(os.sched_getaffinity(0))
        pin_process(cpus)
        try:
            self._engine.add_request(uuid.uuid4().hex, prompt, self._params)
            start = time.monotonic_ns()
            stamps = []
            while self._engine.has_unfinished_requests():
                if self._engine.step():
                    stamps.append(time.monotonic_ns())
        finally:
            pin_process(before)
        self._ttfts.append(stamps[0] - start)
        self._periods.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))

    def summary(self) -> dict[str, float]:
        return {"ttft_us": statistics.median(self._ttfts) / 1000, "tpot_us": statistics.median(self._periods) / 1000}
