"""KV block math: weight bytes, KV bytes per token, how many blocks fit, and what that allows.

The engine sizes its cache as ``engine.device_side._num_kv_blocks`` does: on a GPU,
``memory × gpu_memory_utilization − weights − runtime reserve``; on the CPU,
``kv_cache_memory_gb`` (1 GiB by default). ``max_concurrency`` is vLLM's
start-up figure, ``kv_tokens / max_model_len``: how many requests of the
full length fit at once.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedllm.planning.gpu_catalog import GIB, Accelerator
from pagedllm.planning.model_catalog import ModelSpec
from pagedllm.core.kv_sizing import CPU_KV_BUDGET_BYTES, kv_block_bytes
from pagedllm.distributed.sharding import ModelShape, ShardLayout, shard_layout

# "fp8", "fp8_e4m3", "fp8_e5m2": an 8-bit KV cache (the engine's kv_cache_dtype names the last two).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class Deployment:
    """One replica: a model on ``tensor_parallel_size`` accelerators with the engine's settings."""

    model: ModelSpec
    gpu: Accelerator
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's own limit, as the engine defaults
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory_gb: float | None = None  # CPU only: the engine's kv_cache_memory_gb

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r} is invalid: "
                                 f"expected one of {', '.join(DTYPE_BYTES)}")
        positive = ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} is invalid: expected >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization={self.gpu_memory_utilization} is invalid: expected in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len={self.max_model_len} is invalid: expected >= 1")

    @property
    def context_len(self) -> int:
        return self.max_model_len if self.max_model_len is not None else self.model.context_limit


@dataclass(frozen=True, slots=True)
class KvCapacity:
    weights_bytes_per_gpu: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    num_kv_blocks: int  # what the memory holds
    kv_tokens: int
    max_model_len: int
    max_concurrency: float
    engine_kv_blocks: int  # what the engine allocates: never more than max_num_seqs full-length sequences use


def rank_layout(model: ModelSpec, tensor_parallel_size: int) -> ShardLayout:
    """What one GPU holds, by the engine's own sharding rules (``pagedllm.distributed.sharding``)."""
    shape = ModelShape(model.num_heads, model.num_kv_heads, model.head_dim, model.intermediate_size, model.vocab_size)
    try:
        return shard_layout(shape, 0, tensor_parallel_size)
    except ValueError as error:
        raise ValueError(f"{model.name}: {error}") from None


def kv_heads_per_gpu(model: ModelSpec, tensor_parallel_size: int) -> int:
    """KV heads each GPU holds; replicated (one per GPU) when there are more GPUs than KV heads, as in vLLM."""
    return rank_layout(model, tensor_parallel_size).num_kv_heads


def weights_bytes_per_gpu(model: ModelSpec, dtype: str, tensor_parallel_size: int) -> int:
    """Weights on one GPU: layers and vocabulary sharded, K/V projections replicated past the KV head count."""
    layout = rank_layout(model, tensor_parallel_size)
    kv_width = layout.num_kv_heads * model.head_dim
    q_width = layout.num_heads * model.head_dim
    per_layer = 2 * model.hidden_size * q_width + 2 * model.hidden_size * kv_width
    if model.qkv_bias:
        per_layer += q_width + 2 * kv_width
    tables = 1 if model.tie_word_embeddings else 2
    # Gated MLPs and every expert split by their intermediate rows (each rank holds a slice of every expert).
    params = (model.num_layers * per_layer + model.mlp_params // layout.size
              + tables * layout.vocab_per_rank * model.hidden_size + model.norm_params)
    return params * DTYPE_BYTES[dtype]


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str, tensor_parallel_size: int) -> int:
    """K and V of one token in every layer, on one GPU."""
    heads = kv_heads_per_gpu(model, tensor_parallel_size)
    return kv_block_bytes(model.num_layers, heads, model.head_dim, 1, DTYPE_BYTES[kv_dtype])


def kv_budget_per_gpu(deployment: Deployment, weights_bytes: int) -> int:
    gpu = deployment.gpu
    if gpu.is_cpu:
        if deployment.kv_cache_memory_gb is not None:
            return int(deployment.kv_cache_memory_gb * GIB)
        return CPU_KV_BUDGET_BYTES
    return int(gpu.memory_bytes * deployment.gpu_memory_utilization) - weights_bytes - gpu.runtime_reserve_bytes


def max_concurrency(kv_tokens: int, max_model_len: int) -> float:
    """vLLM's "Maximum concurrency for N tokens per request": full-length requests the cache holds at once."""
    return kv_tokens / max_model_len


def capacity(deployment: Deployment) -> KvCapacity:
    weights = weights_bytes_per_gpu(deployment.model, deployment.dtype, deployment.tensor_parallel_size)
    per_token = kv_bytes_per_token(deployment.model, deployment.kv_dtype, deployment.tensor_parallel_size)
    budget = kv_budget_per_gpu(deployment, weights)
    blocks = max(0, budget // (per_token * deployment.block_size))
    kv_tokens = blocks * deployment.block_size
    length = deployment.context_len
    enough = deployment.max_num_seqs * -(-length // deployment.block_size)
    return KvCapacity(weights, per_token, budget, blocks, kv_tokens, length, max_concurrency(kv_tokens, length),
                      min(blocks, enough))


def max_model_len_table(kv_tokens: int, model_limit: int, chosen: int) -> dict[int, float]:
    """max_model_len → max concurrency, over powers of two from 1024 up to the model's limit."""
    lengths = {chosen, model_limit}
    length = 1024
    while length < model_limit:
        lengths.add(length)
        length *= 2
    return {n: max_concurrency(kv_tokens, n) for n in sorted(lengths)}


def block_size_table(requests: Iterable[tuple[int, int]], block_sizes: Sequence[int] = BLOCK_SIZES) -> dict[int, float]:
    """Block size → expected KV waste in % for these (prompt, output) lengths.

    Each sequence holds ``ceil(L / b)`` blocks at length ``L``; averaged over
    every decode step of every request (lengths prompt+1 … prompt+output),
    the empty slots of its last block are the waste.
    """
    pairs = list(requests)
    if not pairs:
        return {b: 0.0 for b in block_sizes}
    lengths = np.concatenate([np.arange(p + 1, p + o + 1, dtype=np.int64) for p, o in pairs])
    table = {}
    for b in block_sizes:
        allocated = -(-lengths // b) * b
        table[b] = 100.0 * float((allocated - lengths).sum()) / float(allocated.sum())
    return table
