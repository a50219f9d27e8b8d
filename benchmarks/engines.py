"""One timed replay of a workload per engine; every runner returns the same ``RunResult``.

Model loading and a one-request warm-up happen before the clock starts. The
clock covers submitting every request until the last token is back, so each
row is the wall time a user would see for the whole workload.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.simulation.workloads import Workload, WorkloadRequest

ENGINES = ("pagedllm-continuous", "pagedllm-static", "hf-generate", "hf-continuous")
BASELINE = "pagedllm-continuous"


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What every engine in one comparison shares."""

    max_num_seqs: int  # requests decoded together (static batch size for the static baselines)
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    sample_requests: int  # how many leading requests' tokens are kept for the agreement check
    dtype: str = "float32"  # what every engine computes in: float32 or bfloat16


@dataclass(frozen=True, slots=True)
class RunResult:
    engine: str
    seconds: float
    output_tokens: int  # tokens the workload asked for
    computed_tokens: int  # tokens the engine decoded, padding rows of static batches included
    samples: dict[int, list[int]] = field(default_factory=dict)  # request index -> tokens of its first sample
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "seconds": self.seconds, "output_tokens": self.output_tokens,
                "computed_tokens": self.computed_tokens, "tokens_per_s": self.tokens_per_s,
                "samples": {str(k): v for k, v in self.samples.items()}, "extra": self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        samples = {int(k): list(v) for k, v in data.get("samples", {}).items()}
        return cls(data["engine"], data["seconds"], data["output_tokens"], data["computed_tokens"], samples,
                   data.get("extra", {}))


def runner(engine: str) -> Callable[[Path, Workload, EngineSettings], RunResult]:
    if engine in ("pagedllm-continuous", "pagedllm-static"):
        return lambda model, workload, settings: run_pagedllm(model, workload, settings, engine.split("-")[1])
    if engine == "hf-generate":
        from pagedllm_bench.hf_engines import run_hf_generate

        return run_hf_generate
    if engine == "hf-continuous":
        from pagedllm_bench.hf_engines import run_hf_continuous

        return run_hf_continuous
    raise ValueError(f"engine={engine!r} is invalid: expected one of {', '.join(ENGINES)}")


def run_pagedllm(model: Path, workload: Workload, settings: EngineSettings, scheduling: str) -> RunResult:
    from pagedllm import LLM

    llm = LLM(
        model=str(model), dtype=settings.dtype, block_size=settings.block_size, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, max_model_len=settings.max_model_len,
        scheduling=scheduling, seed=workload.seed,
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], pagedllm_params(WorkloadRequest((1, 2, 3), 2)))
    llm.engine.kv.reset_prefix_cache()  # the warm-up must not seed the prefix cache
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload.requests]
    params = [pagedllm_params(r) for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    generated = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    samples = {i: list(outputs[i].outputs[0].token_ids) for i in range(min(settings.sample_requests, len(outputs)))}
    extra = {"preemptions": stats.num_preemptions, "peak_blocks_used": stats.peak_blocks_used,
             "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens, "num_kv_blocks": stats.num_blocks_total}
    return RunResult(f"pagedllm-{scheduling}", seconds, workload.num_output_tokens, generated, samples, extra)


def pagedllm_params(request: WorkloadRequest) -> Any:
    from pagedllm import SamplingParams

    return SamplingParams(n=request.n, temperature=request.temperature, seed=request.seed,
                          max_tokens=request.max_tokens, ignore_eos=True)


def agreement(reference: RunResult, other: RunResult) -> tuple[int, int, float] | None:
    """(requests identical, requests compared, share of tokens equal before the first divergence)."""
    shared = sorted(set(reference.samples) & set(other.samples))
    if not shared:
        return None
    identical = 0
    matched = total = 0
    for index in shared:
        ref, got = reference.samples[index], other.samples[index]
        prefix = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        identical += ref == got
        matched += prefix
        total += len(ref)
    return identical, len(shared), matched / total if total else 1.0
