#!/usr/bin/env python3
"""Load-test a Triton LLM model over gRPC streaming: TTFT, inter-token latency, output tokens/s.

    python client_examples/load_client.py --concurrency 16 --num-requests 128 \\
        --prompt-words 64 --prompt-dist uniform --output-tokens 128 --output-dist normal --plot load.png

``--concurrency`` clients each keep one request in flight. Prompt lengths (in words)
and output lengths (``max_tokens``, with ``ignore_eos`` so they are exact) are drawn
from the chosen distributions with a fixed seed. Prints percentiles and writes a PNG.
Importable: ``run_load(...)`` returns a ``LoadReport`` (benchmarks reuse it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tqdm import tqdm

WORDS = ("the", "model", "server", "token", "stream", "cache", "block", "batch", "python", "import", "value",
         "request", "latency", "kernel", "memory", "engine", "queue", "thread", "return", "class")
DISTRIBUTIONS = ("fixed", "uniform", "normal", "exponential")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    prompt_words: int
    max_tokens: int
    start: float  # time.perf_counter()
    first_token: float | None
    end: float
    num_tokens: int
    inter_token_latencies: tuple[float, ...]
    error: str | None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def output_tokens_per_s(self) -> float | None:
        """Decode speed seen by this client: tokens after the first over the time they took."""
        if self.first_token is None or self.num_tokens < 2 or self.end <= self.first_token:
            return None
        return (self.num_tokens - 1) / (self.end - self.first_token)


@dataclass(frozen=True, slots=True)
class LoadReport:
    concurrency: int
    records: tuple[RequestRecord, ...]
    wall_s: float

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    def summary(self) -> dict[str, object]:
        ok = self.ok
        ttft = [r.ttft for r in ok if r.ttft is not None]
        itl = [gap for r in ok for gap in r.inter_token_latencies]
        speed = [s for r in ok if (s := r.output_tokens_per_s) is not None]
        tokens = sum(r.num_tokens for r in ok)
        return {
            "concurrency": self.concurrency,
            "requests": len(self.records),
            "errors": len(self.records) - len(ok),
            "wall_s": self.wall_s,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "requests_per_s": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_s": percentiles(ttft),
            "itl_s": percentiles(itl),
            "per_request_output_tokens_per_s": percentiles(speed),
        }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(ordered) / len(ordered)}


def sample_lengths(distribution: str, mean: int, count: int, rng: random.Random) -> list[int]:
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if mean < 1:
        raise ValueError(f"mean length must be >= 1, got {mean}")
    draw = {
        "fixed": lambda: mean,
        "uniform": lambda: rng.randint(max(1, mean // 2), max(1, mean + mean // 2)),
        "normal": lambda: round(rng.gauss(mean, mean / 4)),
        "exponential": lambda: round(rng.expovariate(1 / mean)),
    }[distribution]
    return [max(1, int(draw())) for _ in range(count)]


def make_prompt(num_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def run_load(url: str, model: str, *, concurrency: int, num_requests: int, prompt_words: int = 32,
             prompt_dist: str = "fixed", output_tokens: int = 64, output_dist: str = "fixed", seed: int = 0,
             temperature: float = 0.0, progress: bool = True, timeout_s: float = 600.0) -> LoadReport:
    """Send ``num_requests`` streamed requests, ``concurrency`` at a time; never raises for server errors.

    The ``concurrency`` clients are coroutines on one event loop and one gRPC channel, each
    with one bidirectional stream that carries its requests one after another (as
    tritonclient's ``start_stream`` does): no thread per client or per request, no stream
    set up and torn down per request, and the responses are read straight from the
    protobuf, so the client spends as little as it can of a machine it may share with the
    server. ``timeout_s`` bounds each request.
    """
    if concurrency < 1 or num_requests < 1:
        raise ValueError("concurrency and num_requests must be >= 1")
    rng = random.Random(seed)
    prompt_lengths = sample_lengths(prompt_dist, prompt_words, num_requests, rng)
    output_lengths = sample_lengths(output_dist, output_tokens, num_requests, rng)
    prompts = [make_prompt(n, rng) for n in prompt_lengths]
    requests = [_stream_request(model, str(i), prompts[i], {"max_tokens": output_lengths[i], "temperature": temperature,
                                                          "ignore_eos": True, "seed": seed + i})
                for i in range(num_requests)]
    records: list[RequestRecord | None] = [None] * num_requests
    pending = iter(range(num_requests))

    async def one_client(stub: service_pb2_grpc.GRPCInferenceServiceStub, bar: tqdm) -> None:
        stream = _ClientStream(stub)
        try:
            for index in pending:
                fields = await stream.request(requests[index], timeout_s)
                records[index] = RequestRecord(prompt_lengths[index], output_lengths[index], *fields)
                bar.update(1)
        finally:
            stream.close()

    async def all_clients() -> None:
        async with grpc.aio.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with tqdm(total=num_requests, disable=not progress, desc=f"c={concurrency}", unit="req") as bar:
                await asyncio.gather(*(one_client(stub, bar) for _ in range(min(concurrency, num_requests))))

    began = time.perf_counter()
    asyncio.run(all_clients())
    return LoadReport(concurrency, tuple(records), time.perf_counter() - began)  # type: ignore[arg-type]


def _stream_request(model: str, request_id: str, prompt: str, sampling: dict[str, object]) -> service_pb2.ModelInferRequest:
    """The request ``grpc_stream_client.build_inputs`` describes, as the protobuf the stream carries."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, value in (("text_input", prompt.encode()), ("sampling_parameters", json.dumps(sampling).encode())):
        tensor = request.inputs.add(name=name, datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(value)
    for name in ("stream", "exclude_input_in_output", "return_num_output_tokens"):
        tensor = request.inputs.add(name=name, datatype="BOOL", shape=[1])
        tensor.contents.bool_contents.append(True)
    return request


class _ClientStream:
    """One client's gRPC stream, reused request after request; replaced after a request that failed
    (its stream may still carry that request's leftovers)."""

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
        self._stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None

    async def request(self, request: service_pb2.ModelInferRequest,
                      timeout_s: float) -> tuple[float, float | None, float, int, tuple[float, ...], str | None]:
        """(start, first token, end, tokens, inter-token gaps, error) of one streamed request."""
        start = time.perf_counter()
        first, last, tokens, gaps, error = None, start, 0, [], None
        try:
            async with asyncio.timeout(timeout_s):
                if self._call is None:
                    self._call = self._stub.ModelStreamInfer()
                await self._call.write(request)
                while True:
                    response = await self._call.read()
                    arrived = time.perf_counter()
                    if response is grpc.aio.EOF:
                        error = "the stream ended before the final response"
                        break
                    infer = response.infer_response
                    if infer.id != request.id:  # Triton echoes the id, errors included; skip anything else
                        continue
                    if response.error_message:
                        error = response.error_message
                        break
                    count = _num_output_tokens(infer)
                    if count:
                        if first is None:
                            first = arrived
                        else:
                            gaps.extend([(arrived - last) / count] * count)
                        last = arrived
                        tokens += count
                    if infer.parameters["triton_final_response"].bool_param:
                        break
        except grpc.aio.AioRpcError as failure:  # report, keep loading
            error = f"{failure.code().name}: {failure.details()}"
        except TimeoutError:
            error = f"no final response within {timeout_s:g} s"
        if error is not None:
            self.close()
        return start, first, time.perf_counter(), tokens, tuple(gaps), error

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


def _num_output_tokens(response: service_pb2.ModelInferResponse) -> int:
    """The response's ``num_output_tokens`` (0 for the empty final response)."""
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.name == "num_output_tokens":
            return int(np.frombuffer(raw, dtype=np.uint32)[0])
    return 0


def plot(report: LoadReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = report.ok
    panels = [
        ("time to first token (ms)", [r.ttft * 1e3 for r in ok if r.ttft is not None]),
        ("inter-token latency (ms)", [g * 1e3 for r in ok for g in r.inter_token_latencies]),
        ("per-request output tokens/s", [s for r in ok if (s := r.output_tokens_per_s) is not None]),
    ]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for axis, (title, values) in zip(axes, panels):
        if values:
            axis.hist(values, bins=40, color="#4477aa")
            for q, style in ((0.5, "-"), (0.9, "--"), (0.99, ":")):
                axis.axvline(percentiles(values)[f"p{round(q * 100)}"], color="black", linestyle=style,
                             label=f"p{round(q * 100)}")
            axis.legend()
        axis.set_title(title)
    summary = report.summary()
    figure.suptitle(f"concurrency {report.concurrency}: {summary['requests']} requests, "
                    f"{summary['output_tokens_per_s']:.1f} output tok/s overall, {summary['errors']} errors")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32, help="mean prompt length in words")
    parser.add_argument("--prompt-dist", choices=DISTRIBUTIONS, default="uniform")
    parser.add_argument("--output-tokens", type=int, default=64, help="mean max_tokens (exact: ignore_eos)")
    parser.add_argument("--output-dist", choices=DISTRIBUTIONS, default="uniform")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=Path("load_client.png"))
    parser.add_argument("--json", type=Path, default=None, help="also write the summary and records here")
    args = parser.parse_args()
    report = run_load(args.url, args.model, concurrency=args.concurrency, num_requests=args.num_requests,
                      prompt_words=args.prompt_words, prompt_dist=args.prompt_dist, output_tokens=args.output_tokens,
                      output_dist=args.output_dist, seed=args.seed, temperature=args.temperature)
    summary = report.summary()
    print(f"\n{summary['requests']} requests ({summary['errors']} errors) in {summary['wall_s']:.2f} s, "
          f"concurrency {summary['concurrency']}: {summary['output_tokens_per_s']:.1f} output tok/s, "
          f"{summary['requests_per_s']:.2f} req/s")
    print(f"{'metric':<34}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}")
    for key, label, scale in (("ttft_s", "time to first token (ms)", 1e3), ("itl_s", "inter-token latency (ms)", 1e3),
                              ("per_request_output_tokens_per_s", "per-request output tok/s", 1.0)):
        row = summary[key]
        cells = "".join(f"{'-' if row[q] is None else f'{row[q] * scale:.2f}':>10}"
                        for q in ("p50", "p90", "p99", "mean"))
        print(f"{label:<34}{cells}")
    for record in report.records:
        if record.error:
            print(f"first error: {record.error}", file=sys.stderr)
            break
    plot(report, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "records": [asdict(r) for r in report.records]}, indent=1))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
