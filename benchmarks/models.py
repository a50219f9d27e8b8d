"""The benchmark checkpoints: random-weight models built locally once, then reused.

``tiny`` (~3.4M parameters) is overhead-bound on CPU: it shows what the
scheduler and batching cost. ``small`` (~32M parameters, hidden 512, 8 layers)
is compute-bound on CPU. Both come from ``pagedllm.testing.tiny_model`` and are never
downloaded.

The real sizes (:data:`REAL_SIZES`) are the transformer bodies of checkpoints
people run on CPUs: Qwen2.5-0.5B, Llama-3.2-1B, Qwen2.5-1.5B, and a Qwen3-MoE of
about the 0.5B's size. Layers, widths, heads, rotary and tied heads are the
real ones; the vocabulary is the local 2,048-token tokenizer's (the
benchmark's token ids), so the embedding and the LM head are small. The real
checkpoints' 128-152K-row heads would add 0.14-0.26B parameters each.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.testing.tiny_model import SIZES, ModelSize, make_tiny_model

CACHE_ENV = "PAGEDLLM_BENCH_CACHE"  # where checkpoints are built; default ~/.cache/pagedllm/bench
ARCH = "llama"
SEED = 0
_VOCAB = 2048  # the tiny tokenizer's: the benchmark workloads draw their ids from it
_CORPUS = 1 << 20


@dataclass(frozen=True, slots=True)
class RealSize:
    """A real checkpoint's body: ``arch`` and ``shape`` for ``make_tiny_model``, plus config keys it overrides."""

    arch: str
    shape: ModelSize
    overrides: dict[str, Any] = field(default_factory=dict)


REAL_SIZES: dict[str, RealSize] = {
    # Qwen2: q/k/v bias, tied head, rope theta 1e6, as the tiny qwen2 already is.
    "qwen2.5-0.5b": RealSize("qwen2", ModelSize(896, 24, 14, 2, 4864, _VOCAB, 32768, _CORPUS)),
    "llama-3.2-1b": RealSize("llama", ModelSize(2048, 16, 32, 8, 8192, _VOCAB, 131072, _CORPUS), {
        "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    "qwen2.5-1.5b": RealSize("qwen2", ModelSize(1536, 28, 12, 2, 8960, _VOCAB, 32768, _CORPUS)),
    # 12 layers, every one sparse: 16 experts of width 512 (intermediate // 4), top-4; ~0.34B parameters.
    "qwen3-moe-0.3b": RealSize("qwen3_moe", ModelSize(1024, 12, 16, 4, 2048, _VOCAB, 32768, _CORPUS),
                               {"head_dim": 64, "mlp_only_layers": []}),
}
SIZE_NAMES = (*SIZES, *REAL_SIZES)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedllm" / "bench")


def bench_model(size: str, arch: str = ARCH) -> Path:
    """Directory of the ``size`` checkpoint, built on first use: a ``make_tiny_model`` size of ``arch``, or one
    of :data:`REAL_SIZES` (whose architecture is its own; ``arch`` is ignored)."""
    if size not in SIZE_NAMES:
        raise ValueError(f"size={size!r} is invalid: expected one of {', '.join(SIZE_NAMES)}")
    real = REAL_SIZES.get(size)
    target = cache_dir() / (f"{size}-seed{SEED}" if real else f"{arch}-{size}-seed{SEED}")
    if (target / "model.safetensors").is_file() or (target / "model.safetensors.index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent run never sees half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        if real is None:
            make_tiny_model(staging, arch=arch, seed=SEED, size=size)
        else:
            make_tiny_model(staging, arch=real.arch, seed=SEED, shape=real.shape, overrides=real.overrides)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
