"""What ``pagedllm bench gpu`` measures, apart from the GPU: the roofline, latency percentiles, KV waste, ratios.

The pure arithmetic (tested on CPU) and the two engine drivers it feeds:
``replay_at_rate`` (requests arriving at their times, TTFT and TPOT from the
engine's own outputs) and ``timed_decode`` (decode-only steps of a batch,
tokens per second). The drivers run any ``LLMEngine``; on the GPU they time it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.planning.step_time import ModelCost
from pagedllm.planning.traffic import TimedRequest
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.simulation.null_engine import NullEngine
from pagedllm.simulation.workloads import Workload


def decode_bytes_per_step(cost: ModelCost, batch: int, mean_context: float) -> float:
    """Bytes one decode step of ``batch`` sequences reads: every weight once, plus each sequence's K/V."""
    return cost.weight_bytes_read(batch) + cost.kv_bytes_per_token * batch * mean_context


def roofline_tokens_per_s(cost: ModelCost, batch: int, mean_context: float, bandwidth_bytes_per_s: float) -> float:
    """Decode tokens/s if every step ran at the memory's peak: ``batch`` tokens per step's bytes over the bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s} is invalid: expected > 0")
    return batch * bandwidth_bytes_per_s / decode_bytes_per_step(cost, batch, mean_context)


def speedup(continuous_s: float, static_s: float) -> float:
    """Continuous batching's throughput over static batching's on the same workload: static time / continuous time."""
    if continuous_s <= 0 or static_s <= 0:
        raise ValueError(f"wall times must be > 0, got continuous {continuous_s} s and static {static_s} s")
    return static_s / continuous_s


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request of a timed replay, in seconds from the replay's start."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class LatencySummary:
    requests: int
    wall_s: float  # first arrival to last finish
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float | None  # None when no request produced more than one token
    tpot_p99_s: float | None


def summarize_latency(timings: Seq[RequestTiming]) -> LatencySummary:
    """TTFT is first token minus arrival; TPOT is the time per output token after the first."""
    if not timings:
        raise ValueError("timings is empty: a replay must time at least one request")
    ttft = np.array([t.first_token_s - t.arrival_s for t in timings])
    tpot = np.array([(t.finish_s - t.first_token_s) / (t.output_tokens - 1) for t in timings if t.output_tokens > 1])
    wall = max(t.finish_s for t in timings) - min(t.arrival_s for t in timings)
    return LatencySummary(
        requests=len(timings), wall_s=wall, output_tokens_per_s=sum(t.output_tokens for t in timings) / wall,
        ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_p50_s=float(np.percentile(tpot, 50)) if tpot.size else None,
        tpot_p99_s=float(np.percentile(tpot, 99)) if tpot.size else None,
    )


@dataclass(frozen=True, slots=True)
class KvWaste:
    peak_fraction: float  # at the first step holding the most blocks: share of their slots that hold no token
    mean_fraction: float  # the same share, averaged over steps


def kv_waste(workload: Workload, num_blocks: int, block_size: int, max_num_seqs: int,
             max_num_batched_tokens: int, scheduling: str = "continuous") -> KvWaste:
    """KV slots allocated but empty, replayed on the engine's own scheduler and block manager (the null engine).

    After each step, every running sequence holds ``ceil(n / block_size)`` blocks for its ``n`` computed
    tokens; the empty slots are the tails of those last blocks (prefix-shared blocks are full, so sharing
    adds none), over the slots of every referenced block.
    """
    engine = NullEngine(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, scheduling=scheduling)
    for request in workload.requests:
        engine.add_request(request.prompt_token_ids, SamplingParams(n=request.n, max_tokens=request.max_tokens,
                                                                    ignore_eos=True))
    shares, peak_blocks, peak_share = [], 0, 0.0
    while engine.has_unfinished_requests():
        engine.step()
        blocks = engine.kv.num_used_blocks
        if blocks == 0:
            continue
        empty = sum(-seq.num_computed_tokens % block_size for seq in engine.scheduler.running)
        share = empty / (blocks * block_size)
        shares.append(share)
        if blocks > peak_blocks:
            peak_blocks, peak_share = blocks, share
    return KvWaste(peak_share, float(np.mean(shares)) if shares else 0.0)


def replay_at_rate(engine: LLMEngine, requests: Seq[TimedRequest]) -> list[RequestTiming]:
    """Submit each request at its arrival time (greedy, EOS ignored) and step until all finish."""
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    tokens: dict[str, int] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            request = pending.popleft()
            request_id = f"rate-{len(arrival)}"
            engine.add_request(request_id, list(request.prompt_token_ids),
                               SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True))
            arrival[request_id], tokens[request_id] = request.arrival_s, 0
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            new = sum(len(delta.token_ids) for delta in out.outputs)
            tokens[out.request_id] += new
            if new and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                finish[out.request_id] = now
    return [RequestTiming(arrival[r], first[r], finish[r], tokens[r]) for r in arrival]


def timed_decode(engine: LLMEngine, batch: int, prompt_len: int, output_len: int,
                 generator: torch.Generator) -> tuple[float, float]:
    """(decode tokens/s, mean context) of ``batch`` requests once every prefill is done: the steps timed are
    pure decode steps of the whole batch."""
    if output_len < 2:
        raise ValueError(f"output_len={output_len} is invalid: decode steps need >= 2 output tokens")
    vocab = engine.model.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, torch.randint(3, vocab, (prompt_len,), generator=generator).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill steps (and the first token of each request)
        started.update(out.request_id for out in engine.step() if any(d.token_ids for d in out.outputs))
    generated = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        generated += sum(len(d.token_ids) for out in engine.step() for d in out.outputs)
    elapsed = time.perf_counter() - start
    # The timed steps read contexts prompt_len + 1 ... prompt_len + output_len - 1.
    return generated / elapsed, prompt_len + output_len / 2
