"""A draft checkpoint for tests: the target's own weights with noise, so it agrees with the target only
some of the time (drafts get accepted, and rejected, at every position).

A random-weight tiny model and an independently initialised smaller one agree almost never, which
would leave acceptance untested; a noisy copy shares the tokenizer and vocabulary by construction.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def noisy_draft(target_dir: Path, out_dir: Path, noise: float, seed: int = 0) -> Path:
    """Copy ``target_dir`` to ``out_dir`` with Gaussian noise of ``noise`` times each tensor's std added
    to every floating-point weight; returns ``out_dir``."""
    shutil.copytree(target_dir, out_dir, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for path in out_dir.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                scale = tensor.float().std() * noise
                tensors[name] = (tensor.float() + torch.randn(tensor.shape, generator=generator) * scale).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out_dir
