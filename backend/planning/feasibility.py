"""Plans that cannot work, said plainly, with what would fit.

The suggestions: more tensor parallelism, a bigger GPU, a shorter max_model_len.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace

from pagedllm.planning.gpu_catalog import CATALOG as GPUS
from pagedllm.planning.gpu_catalog import GIB
from pagedllm.planning.kv_math import Deployment, KvCapacity, capacity
from pagedllm.planning.traffic import TimedRequest

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)


class PlanDoesNotFit(ValueError):
    """The reason first, then what would fit."""

    def __init__(self, reason: str, suggestions: Seq[str]) -> None:
        self.reason = reason
        self.suggestions = tuple(suggestions)
        tries = "".join(f"\n  - {s}" for s in self.suggestions)
        super().__init__(f"does not fit: {reason}" + (f"\ntry:{tries}" if tries else ""))


def check(deployment: Deployment, requests: Seq[TimedRequest]) -> KvCapacity:
    """The deployment's KV capacity; raises ``PlanDoesNotFit`` naming the first reason it cannot serve."""
    model = deployment.model
    if deployment.context_len > model.context_limit:
        raise PlanDoesNotFit(
            f"--max-model-len={deployment.context_len} is larger than {model.name}'s limit of {model.context_limit} "
            "tokens (max_position_embeddings)",
            [f"--max-model-len {model.context_limit} or less"])
    longest = max((r.max_len for r in requests), default=0)
    if longest > deployment.context_len:
        raise PlanDoesNotFit(
            f"the workload's longest request needs {longest} tokens (prompt + max_tokens) but max_model_len is "
            f"{deployment.context_len}",
            [f"--max-model-len {_round_up(longest, deployment.block_size)}"] if longest <= model.context_limit
            else [f"shorter requests: {model.name} takes at most {model.context_limit} tokens"])
    cap = capacity(deployment)
    gpu = deployment.gpu
    if gpu.is_cpu and cap.weights_bytes_per_gpu + cap.kv_budget_bytes > gpu.memory_bytes:
        raise PlanDoesNotFit(
            f"{model.name}'s weights ({cap.weights_bytes_per_gpu / GIB:.1f} GiB in {deployment.dtype}) and the "
            f"{cap.kv_budget_bytes / GIB:.1f} GiB KV cache exceed this machine's {gpu.memory_gib:.1f} GiB of RAM",
            ["a smaller model, or --dtype bfloat16"])
    if cap.kv_budget_bytes <= 0:
        usable = cap.kv_budget_bytes + cap.weights_bytes_per_gpu
        raise PlanDoesNotFit(
            f"{model.name}'s weights need {cap.weights_bytes_per_gpu / GIB:.1f} GiB per GPU in {deployment.dtype} at "
            f"--tensor-parallel-size {deployment.tensor_parallel_size}, but a {gpu.name} leaves "
            f"{max(usable, 0) / GIB:.1f} GiB at --gpu-memory-utilization {deployment.gpu_memory_utilization}",
            _bigger(deployment, longest))
    if cap.max_concurrency < 1:
        fits = cap.kv_tokens // deployment.block_size * deployment.block_size
        raise PlanDoesNotFit(
            f"one request of max_model_len={cap.max_model_len} tokens needs "
            f"{cap.max_model_len * cap.kv_bytes_per_token / GIB:.2f} GiB of KV cache, but only "
            f"{cap.kv_budget_bytes / GIB:.2f} GiB ({cap.kv_tokens} tokens) is left after the weights",
            ([f"--max-model-len {fits} or less"] if fits >= max(longest, 1) else []) + _bigger(deployment, longest))
    return cap


def _bigger(deployment: Deployment, longest: int) -> list[str]:
    """More tensor parallelism on the same GPU (with a shorter max_model_len if need be), or a bigger catalog GPU."""
    suggestions: list[str] = []
    shortened = False
    for tp in TENSOR_PARALLEL_SIZES:
        if tp <= deployment.tensor_parallel_size:
            continue
        try:
            cap = capacity(replace(deployment, tensor_parallel_size=tp))
        except ValueError:  # a tensor-parallel size the heads do not divide
            continue
        per_replica = f"--tensor-parallel-size {tp} ({tp} × {deployment.gpu.name} per replica"
        if cap.kv_budget_bytes > 0 and cap.max_concurrency >= 1:
            suggestions.append(per_replica + ")")
            break
        fits = cap.kv_tokens // deployment.block_size * deployment.block_size
        if cap.kv_budget_bytes > 0 and fits >= max(longest, 1) and not shortened:
            suggestions.append(f"{per_replica}) with --max-model-len {fits} or less")
            shortened = True
    if not deployment.gpu.is_cpu:
        bigger = [name for name, gpu in GPUS.items()
                  if gpu.memory_bytes > deployment.gpu.memory_bytes and _fits(replace(deployment, gpu=gpu))]
        if bigger:
            suggestions.append(f"a GPU with more memory: --gpu {' or --gpu '.join(bigger)}")
    return suggestions


def _fits(deployment: Deployment) -> bool:
    try:
        cap = capacity(deployment)
    except ValueError:  # a tensor-parallel size the heads do not divide
        return False
    return cap.kv_budget_bytes > 0 and cap.max_concurrency >= 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
