#!/usr/bin/env python3
"""Load-test an OpenAI-compatible /v1/chat/completions endpoint with streams: TTFT, inter-token latency, tokens/s.

    python client_examples/openai_load_client.py --base-url http://localhost:9000/v1 --model llm \\
        --concurrency 32 --num-requests 128 --prompt-words 32 --output-tokens 64

The twin of ``load_client.py`` (gRPC): the same prompts and ``max_tokens`` for the same
arguments and seed, the same report, so the two paths compare side by side. Each
request is one user message with ``ignore_eos`` (a vLLM extra) so output lengths are
exact; tokens are counted from the final ``usage`` chunk. It speaks plain HTTP + SSE
with ``requests`` so the client's own cost stays as small as the gRPC client's.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_client import DISTRIBUTIONS, LoadReport, RequestRecord, make_prompt, sample_lengths  # noqa: E402


def stream_chat(session: requests.Session, base_url: str, body: dict[str, object]) -> tuple[list[float], int]:
    """Arrival times of the chunks that carried text, and the completion tokens from ``usage``."""
    arrivals: list[float] = []
    completion_tokens = 0
    with session.post(f"{base_url}/chat/completions", json=body, stream=True, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            if any(choice["delta"].get("content") for choice in chunk["choices"]):
                arrivals.append(time.perf_counter())
    return arrivals, completion_tokens


def run_load(base_url: str, model: str, *, concurrency: int, num_requests: int, prompt_words: int = 32,
             prompt_dist: str = "fixed", output_tokens: int = 64, output_dist: str = "fixed", seed: int = 0,
             temperature: float = 0.0, progress: bool = True) -> LoadReport:
    """Send ``num_requests`` streamed chat requests, ``concurrency`` at a time; never raises for server errors."""
    if concurrency < 1 or num_requests < 1:
        raise ValueError("concurrency and num_requests must be >= 1")
    rng = random.Random(seed)  # the same draws, in the same order, as load_client.run_load
    prompt_lengths = sample_lengths(prompt_dist, prompt_words, num_requests, rng)
    output_lengths = sample_lengths(output_dist, output_tokens, num_requests, rng)
    prompts = [make_prompt(n, rng) for n in prompt_lengths]
    local = threading.local()

    def one(i: int) -> RequestRecord:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        body = {"model": model, "messages": [{"role": "user", "content": prompts[i]}], "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": output_lengths[i],
                "temperature": temperature, "ignore_eos": True, "seed": seed + i}
        start = time.perf_counter()
        arrivals, tokens, error = [], 0, None
        try:
            arrivals, tokens = stream_chat(local.session, base_url, body)
        except Exception as failure:  # report, keep loading
            error = str(failure)
        # A stream sends one chunk per engine step, which is one token of a single-sample request.
        gaps = tuple(later - earlier for earlier, later in zip(arrivals, arrivals[1:]))
        return RequestRecord(prompt_lengths[i], output_lengths[i], start, arrivals[0] if arrivals else None,
                             time.perf_counter(), tokens, gaps, error)

    began = time.perf_counter()
    records = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool, \
            tqdm(total=num_requests, disable=not progress, desc=f"chat c={concurrency}", unit="req") as bar:
        for record in pool.map(one, range(num_requests)):
            records.append(record)
            bar.update(1)
    return LoadReport(concurrency, tuple(records), time.perf_counter() - began)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://localhost:9000/v1")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32, help="mean prompt length in words")
    parser.add_argument("--prompt-dist", choices=DISTRIBUTIONS, default="uniform")
    parser.add_argument("--output-tokens", type=int, default=64, help="mean max_tokens (exact: ignore_eos)")
    parser.add_argument("--output-dist", choices=DISTRIBUTIONS, default="uniform")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report = run_load(args.base_url, args.model, concurrency=args.concurrency, num_requests=args.num_requests,
                      prompt_words=args.prompt_words, prompt_dist=args.prompt_dist, output_tokens=args.output_tokens,
                      output_dist=args.output_dist, seed=args.seed, temperature=args.temperature)
    summary = report.summary()
    print(json.dumps(summary, indent=1))
    first_error = next((r.error for r in report.records if r.error), None)
    if first_error:
        print(f"first error: {first_error}", file=sys.stderr)
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
