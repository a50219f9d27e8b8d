"""Replay traffic through the engine's own Scheduler and KVCacheManager, with a step-time model as the clock.

``NullEngine`` is the engine with the forward pass taken out, so this replay
takes exactly the steps the engine would (same admissions, chunking,
preemptions, prefix hits); only each step's duration comes from the model.
Requests join when the clock passes their arrival; a token sampled in a step
exists at the end of that step. TTFT is first token − arrival; TPOT is
(finish − first token) / (output tokens − 1), as vLLM's benchmarks define them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import numpy as np

from pagedllm.simulation.null_engine import NullEngine
from pagedllm.core.request import Request
from pagedllm.planning.step_time import StepShape
from pagedllm.planning.traffic import TimedRequest
from pagedllm.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The engine settings that decide the schedule."""

    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class ReplayResult:
    steps: int
    predicted_wall_s: float
    output_tokens: int
    ttft_s: tuple[float, ...]  # one per request
    tpot_s: tuple[float, ...]  # one per request with more than one output token
    preemptions: int
    kv_peak_usage: float  # peak share of KV blocks referenced
    kv_usage: tuple[tuple[float, float], ...] = ()  # (time, share of blocks referenced) after each step

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.predicted_wall_s if self.predicted_wall_s > 0 else 0.0

    def ttft(self, q: float) -> float | None:
        return _percentile(self.ttft_s, q)

    def tpot(self, q: float) -> float | None:
        return _percentile(self.tpot_s, q)


@dataclass(slots=True)
class _Timing:
    arrival_s: float
    output_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None


def replay(requests: Seq[TimedRequest], limits: EngineLimits, clock: Callable[[StepShape], float]) -> ReplayResult:
    """Run ``requests`` to completion; ``clock(shape)`` is the duration of a step of that shape."""
    too_long = [r for r in requests if -(-r.max_len // limits.block_size) > limits.num_kv_blocks]
    if too_long:
        raise ValueError(f"a request of {too_long[0].max_len} tokens can never fit in {limits.num_kv_blocks} KV blocks "
                         f"of {limits.block_size} tokens")
    engine = NullEngine(limits.num_kv_blocks, limits.block_size, limits.max_num_seqs, limits.max_num_batched_tokens,
                        enable_prefix_caching=limits.enable_prefix_caching)
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    timings: dict[Request, _Timing] = {}
    usage: list[tuple[float, float]] = []
    now, steps = 0.0, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_s <= now:
            timed = pending.popleft()
            request = engine.add_request(timed.prompt_token_ids,
                                         SamplingParams(n=timed.n, max_tokens=timed.max_tokens, ignore_eos=True))
            timings[request] = _Timing(timed.arrival_s, timed.max_tokens)
        if not engine.has_unfinished_requests():
            now = pending[0].arrival_s
            continue
        step = engine.step()
        steps += 1
        now += clock(StepShape.of(step))
        usage.append((now, engine.kv.num_used_blocks / engine.kv.num_blocks))
        sampled = {seq.request for seq in step.samples} | {batch.request for batch in step.beams}
        for request in sampled:
            timing = timings[request]
            if timing.first_token_s is None:
                timing.first_token_s = now
            if timing.finish_s is None and request.is_finished:
                timing.finish_s = now
    done = list(timings.values())
    return ReplayResult(
        steps=steps,
        predicted_wall_s=max((t.finish_s or 0.0 for t in done), default=0.0),
        output_tokens=sum(r.max_tokens * r.n for r in requests),
        ttft_s=tuple(t.first_token_s - t.arrival_s for t in done if t.first_token_s is not None),
        tpot_s=tuple((t.finish_s - t.first_token_s) / (t.output_tokens - 1) for t in done
                     if t.finish_s is not None and t.first_token_s is not None and t.output_tokens > 1),
        preemptions=engine.scheduler.num_preemptions,
        kv_peak_usage=engine.kv.peak_blocks_used / engine.kv.num_blocks,
        kv_usage=tuple(usage),
    )


def replay_replicas(requests: Seq[TimedRequest], replicas: int, limits: EngineLimits,
                    clock: Callable[[StepShape], float]) -> ReplayResult:
    """``replicas`` identical engines, requests dealt round-robin in arrival order; latencies pooled."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas} is invalid: expected >= 1")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    parts = [replay(ordered[i::replicas], limits, clock) for i in range(min(replicas, len(ordered)))]
    wall = max(p.predicted_wall_s for p in parts)
    return ReplayResult(
        steps=sum(p.steps for p in parts),
        predicted_wall_s=wall,
        output_tokens=sum(p.output_tokens for p in parts),
        ttft_s=tuple(x for p in parts for x in p.ttft_s),
        tpot_s=tuple(x for p in parts for x in p.tpot_s),
        preemptions=sum(p.preemptions for p in parts),
        kv_peak_usage=max(p.kv_peak_usage for p in parts),
        kv_usage=parts[0].kv_usage,
    )


def _percentile(values: tuple[float, ...], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
