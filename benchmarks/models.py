"""The benchmark checkpoints: random-weight Llama models built locally once, then reused.

``tiny`` (~3.4M parameters) is overhead-bound on CPU: it shows what the
scheduler and batching cost. ``small`` (~32M parameters, hidden 512, 8 layers)
is compute-bound on CPU. Both come from ``pagedllm.testing.tiny_model`` and are never
downloaded.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from pagedllm.testing.tiny_model import SIZES, make_tiny_model

CACHE_ENV = "PAGEDLLM_BENCH_CACHE"  # where checkpoints are built; default ~/.cache/pagedllm/bench
ARCH = "llama"
SEED = 0


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedllm" / "bench")


def bench_model(size: str, arch: str = ARCH) -> Path:
    """Directory of the ``size`` checkpoint of ``arch`` (a ``make_tiny_model`` architecture), built on first use."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is invalid: expected one of {', '.join(SIZES)}")
    target = cache_dir() / f"{arch}-{size}-seed{SEED}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent run never sees half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make_tiny_model(staging, arch=arch, seed=SEED, size=size)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

