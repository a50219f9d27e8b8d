"""A capacity plan: KV block math for one replica, the traffic replayed on it, and how many replicas meet the SLOs.

``Plan.to_json`` holds the contract keys of ``pagedllm plan --json`` at the top
level (static: weights_bytes_per_gpu … block_size_table; simulated: steps …
kv_peak_usage; replicas_needed), plus ``inputs`` (what was planned) and
``advice`` (the table's sentences).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from pagedllm.planning import feasibility
from pagedllm.planning.gpu_catalog import GIB
from pagedllm.planning.kv_math import Deployment, KvCapacity, block_size_table, max_model_len_table
from pagedllm.planning.replay import EngineLimits, ReplayResult, replay_replicas
from pagedllm.planning.step_time import ModelCost, StepShape, StepTimeModel
from pagedllm.planning.traffic import TimedRequest

MAX_REPLICAS = 1024


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None

    def __post_init__(self) -> None:
        for flag, value in (("--ttft-p99", self.ttft_p99_s), ("--tpot-p99", self.tpot_p99_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag}={value} is invalid: expected seconds > 0")

    @property
    def is_set(self) -> bool:
        return self.ttft_p99_s is not None or self.tpot_p99_s is not None

    def met_by(self, result: ReplayResult) -> bool:
        ttft, tpot = result.ttft(99), result.tpot(99)
        return ((self.ttft_p99_s is None or ttft is None or ttft <= self.ttft_p99_s)
                and (self.tpot_p99_s is None or tpot is None or tpot <= self.tpot_p99_s))


@dataclass(frozen=True, slots=True)
class Plan:
    deployment: Deployment
    capacity: KvCapacity
    step_model: StepTimeModel
    requests: tuple[TimedRequest, ...]
    slo: Slo
    by_replicas: dict[int, ReplayResult]  # replica count -> pooled replay; always holds 1
    replicas_needed: int | None  # None without SLOs, or when no replica count meets them
    max_model_len_table: dict[int, float] = field(default_factory=dict)
    block_size_table: dict[int, float] = field(default_factory=dict)

    @property
    def replay(self) -> ReplayResult:
        return self.by_replicas[1]

    def to_json(self) -> dict[str, Any]:
        cap, run, d = self.capacity, self.replay, self.deployment
        return {
            **capacity_json(d, cap),
            "block_size_table": {str(k): v for k, v in self.block_size_table.items()},
            "steps": run.steps,
            "predicted_wall_s": run.predicted_wall_s,
            "throughput_tok_s": run.throughput_tok_s,
            "ttft_p50": run.ttft(50),
            "ttft_p99": run.ttft(99),
            "tpot_p50": run.tpot(50),
            "tpot_p99": run.tpot(99),
            "preemptions": run.preemptions,
            "kv_peak_usage": run.kv_peak_usage,
            "replicas_needed": self.replicas_needed,
            "inputs": {
                "model": d.model.name, "gpu": d.gpu.name, "dtype": d.dtype, "kv_dtype": d.kv_dtype,
                "tensor_parallel_size": d.tensor_parallel_size, "block_size": d.block_size,
                "gpu_memory_utilization": d.gpu_memory_utilization, "max_model_len": cap.max_model_len,
                "max_num_seqs": d.max_num_seqs, "max_num_batched_tokens": d.max_num_batched_tokens,
                "engine_kv_blocks": cap.engine_kv_blocks, "requests": len(self.requests),
                "ttft_p99_slo": self.slo.ttft_p99_s, "tpot_p99_slo": self.slo.tpot_p99_s,
                "step_time_model": self.step_model.to_json(),
            },
            "advice": self.advice(),
        }

    def advice(self) -> list[str]:
        cap, d = self.capacity, self.deployment
        lines = [f"max_model_len {cap.max_model_len:,}: KV cache for {cap.kv_tokens:,} tokens = "
                 f"{cap.max_concurrency:.2f}× concurrency at full length (vLLM's figure)"]
        longest = max((r.max_len for r in self.requests), default=0)
        if 0 < longest < cap.max_model_len // 2:
            shorter = max(1024, 1 << (longest - 1).bit_length())
            if shorter < cap.max_model_len:
                lines.append(f"the longest request here is {longest:,} tokens: --max-model-len {shorter:,} gives "
                             f"{cap.kv_tokens / shorter:.1f}× concurrency ({cap.max_model_len // shorter}× more "
                             "full-length requests at once, same memory)")
        if self.requests:
            mean = sum(r.max_len * r.n for r in self.requests) / sum(r.n for r in self.requests)
            lines.append(f"paged blocks hold what requests use: about {cap.kv_tokens / mean:,.0f} requests of this "
                         f"traffic's mean length ({mean:,.0f} tokens) fit at once; --max-num-seqs is {d.max_num_seqs}")
        if self.block_size_table:
            waste = self.block_size_table.get(d.block_size)
            if waste is not None:
                lines.append(f"block size {d.block_size} wastes {waste:.1f}% of the KV slots on this traffic")
        run = self.replay
        if run.preemptions:
            lines.append(f"{run.preemptions} preemptions: the KV cache ran out under this load; more memory per "
                         "replica (tensor parallelism, a bigger GPU) or fewer --max-num-seqs avoid the recompute")
        if self.slo.is_set and self.replicas_needed is None:
            tried = max(self.by_replicas)
            worst = self.by_replicas[tried]
            lines.append(f"no replica count meets the SLOs: even {tried} replicas give TTFT p99 "
                         f"{_seconds(worst.ttft(99))}, TPOT p99 {_seconds(worst.tpot(99))}")
        elif self.replicas_needed is not None:
            lines.append(f"{self.replicas_needed} replica(s) of {d.tensor_parallel_size} × {d.gpu.name} meet the SLOs "
                         f"({self.replicas_needed * d.tensor_parallel_size} GPUs)")
        return lines


def make_plan(deployment: Deployment, requests: Seq[TimedRequest], step_model: StepTimeModel, slo: Slo = Slo(),
              enable_prefix_caching: bool = True, replica_counts: Seq[int] = ()) -> Plan:
    """Check the deployment fits, replay the traffic on one replica, then search replicas for the SLOs."""
    cap = feasibility.check(deployment, requests)
    limits = EngineLimits(cap.engine_kv_blocks, deployment.block_size, deployment.max_num_seqs,
                          deployment.max_num_batched_tokens, enable_prefix_caching)
    cost = ModelCost.of(deployment.model, deployment.dtype, deployment.kv_dtype, deployment.tensor_parallel_size)
    clock: Callable[[StepShape], float] = lambda shape: step_model.seconds(cost, shape)
    by_replicas = {1: replay_replicas(requests, 1, limits, clock)}
    needed = _replicas_needed(requests, limits, clock, slo, by_replicas) if slo.is_set else None
    for count in replica_counts:
        if count not in by_replicas:
            by_replicas[count] = replay_replicas(requests, count, limits, clock)
    return Plan(
        deployment, cap, step_model, tuple(requests), slo, dict(sorted(by_replicas.items())), needed,
        max_model_len_table(cap.kv_tokens, deployment.model.context_limit, cap.max_model_len),
        block_size_table((len(r.prompt_token_ids), r.max_tokens) for r in requests),
    )


def _replicas_needed(requests: Seq[TimedRequest], limits: EngineLimits, clock: Callable[[StepShape], float],
                     slo: Slo, tried: dict[int, ReplayResult]) -> int | None:
    """Smallest replica count meeting the SLOs: doubling, then bisection (latency falls as replicas grow)."""
    ceiling = min(MAX_REPLICAS, max(1, len(requests)))

    def meets(count: int) -> bool:
        if count not in tried:
            tried[count] = replay_replicas(requests, count, limits, clock)
        return slo.met_by(tried[count])

    high = 1
    while not meets(high):
        if high >= ceiling:
            return None
        high = min(2 * high, ceiling)
    low = high // 2  # fails (or is 0)
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


def capacity_summary(deployment: Deployment, cap: KvCapacity) -> str:
    """The memory side of a plan, for when no traffic is given to replay."""
    rows = _capacity_rows(deployment, cap)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    table = max_model_len_table(cap.kv_tokens, deployment.model.context_limit, cap.max_model_len)
    lines += ["", "max_model_len → max concurrency"] + [f"  {n:>9,}  {c:10.2f}×" for n, c in table.items()]
    return "\n".join(lines)


def capacity_json(deployment: Deployment, cap: KvCapacity) -> dict[str, Any]:
    """The fields of :func:`capacity_summary`'s table, as numbers: what ``plan --json`` prints without traffic."""
    d, model = deployment, deployment.model
    table = max_model_len_table(cap.kv_tokens, model.context_limit, cap.max_model_len)
    fields: dict[str, Any] = {
        "model": model.name, "num_params": model.num_params, "dtype": d.dtype, "kv_dtype": d.kv_dtype,
        "gpu": d.gpu.name, "gpu_memory_gib": d.gpu.memory_gib, "tensor_parallel_size": d.tensor_parallel_size,
        "weights_bytes_per_gpu": cap.weights_bytes_per_gpu,
        "kv_bytes_per_token": cap.kv_bytes_per_token,
        "block_size": d.block_size,
        "num_kv_blocks": cap.num_kv_blocks,
        "kv_tokens": cap.kv_tokens,
        "kv_budget_bytes": cap.kv_budget_bytes,
        "max_model_len": cap.max_model_len,
        "max_concurrency": cap.max_concurrency,
        "max_model_len_table": {str(k): v for k, v in table.items()},
    }
    if model.is_moe:
        cost = ModelCost.of(model, d.dtype, d.kv_dtype, d.tensor_parallel_size)
        fields["active_params"] = model.active_params
        fields["weight_bytes_read_per_gpu_by_seqs"] = {
            str(b): cost.weight_bytes_read(b) for b in sorted({1, 16, d.max_num_seqs})}
    return fields


def _capacity_rows(d: Deployment, cap: KvCapacity) -> list[tuple[str, str]]:
    return [
        ("model", f"{d.model.name} ({d.model.num_params / 1e9:.2f}B parameters, {d.dtype}, KV {d.kv_dtype})"),
        ("hardware", f"{d.tensor_parallel_size} × {d.gpu.name} ({d.gpu.memory_gib:.1f} GiB)"),
        ("weights per GPU", f"{cap.weights_bytes_per_gpu / GIB:.2f} GiB"),
        *_moe_rows(d),
        ("KV bytes per token", f"{cap.kv_bytes_per_token:,}"),
        ("KV blocks", f"{cap.num_kv_blocks:,} × {d.block_size} tokens = {cap.kv_tokens:,} tokens "
                      f"({cap.kv_budget_bytes / GIB:.2f} GiB)"),
        ("max concurrency", f"{cap.max_concurrency:.2f}× at max_model_len {cap.max_model_len:,}"),
    ]


def _moe_rows(d: Deployment) -> list[tuple[str, str]]:
    """A mixture of experts: parameters a token uses, and the weight bytes a decode step reads at 1 and at
    ``max_num_seqs`` running sequences (the experts their tokens are expected to touch)."""
    model = d.model
    if not model.is_moe:
        return []
    cost = ModelCost.of(model, d.dtype, d.kv_dtype, d.tensor_parallel_size)
    read = [f"{cost.weight_bytes_read(b) / GIB:.2f} GiB at {b} seqs ({model.experts_touched(b):.1f} experts)"
            for b in sorted({1, 16, d.max_num_seqs})]
    return [("active parameters", f"{model.active_params / 1e9:.2f}B per token ({model.experts_per_token} of "
                                  f"{model.num_experts} experts a layer)"),
            ("active bytes per decode step", ", ".join(read) + " per GPU")]


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g} s"


def summary(plan: Plan) -> str:
    """The plan as the text table ``pagedllm plan`` prints."""
    cap, run, d = plan.capacity, plan.replay, plan.deployment
    rows = [
        *_capacity_rows(d, cap),
        ("step-time model", plan.step_model.source),
        ("requests", f"{len(plan.requests)} ({sum(r.max_tokens * r.n for r in plan.requests):,} output tokens)"),
        ("engine steps", f"{run.steps:,}"),
        ("predicted wall", f"{run.predicted_wall_s:.3g} s ({run.throughput_tok_s:,.0f} output tok/s)"),
        ("TTFT p50 / p99", f"{_seconds(run.ttft(50))} / {_seconds(run.ttft(99))}"),
        ("TPOT p50 / p99", f"{_seconds(run.tpot(50))} / {_seconds(run.tpot(99))}"),
        ("preemptions", f"{run.preemptions}"),
        ("KV peak usage", f"{100 * run.kv_peak_usage:.1f}%"),
    ]
    if plan.slo.is_set:
        rows.append(("replicas needed", "none meets the SLOs" if plan.replicas_needed is None
                     else f"{plan.replicas_needed}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", "max_model_len → max concurrency"]
    lines += [f"  {n:>9,}  {c:10.2f}×" for n, c in plan.max_model_len_table.items()]
    lines += ["", "block size → expected KV waste"]
    lines += [f"  {b:>9}  {w:9.2f}%" for b, w in plan.block_size_table.items()]
    lines += [""] + [f"- {line}" for line in plan.advice()]
    return "\n".join(lines)
