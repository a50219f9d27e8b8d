"""Paged-attention kernels: Triton-lang implementations and plain-torch references.

The Triton-lang kernels load lazily (attribute access or :func:`triton_backend_ops`),
so importing this package never imports ``triton``: the references work where
triton is absent. Set ``TRITON_INTERPRET=1`` before the first access to run the
kernels on CPU tensors.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.kernels.reference import copy_blocks_ref, unified_attention_ref, write_kv_ref

_TRITON_OPS = {
    "unified_attention": "pagedllm.kernels.attention_launch",
    "plan_unified_attention": "pagedllm.kernels.attention_launch",
    "unified_attention_planned": "pagedllm.kernels.attention_launch",
    "write_kv": "pagedllm.kernels.kv_write",
    "copy_blocks": "pagedllm.kernels.block_copy",
}

__all__ = ["copy_blocks", "copy_blocks_ref", "plan_unified_attention", "triton_backend_ops", "unified_attention",
           "unified_attention_planned", "unified_attention_ref", "write_kv", "write_kv_ref"]


def __getattr__(name: str) -> Any:
    if name in _TRITON_OPS:
        return getattr(importlib.import_module(_TRITON_OPS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def triton_backend_ops() -> tuple[Callable[..., torch.Tensor], Callable[..., None], Callable[..., None]]:
    """The Triton-lang ``(unified_attention, write_kv, copy_blocks)``, imported on first use."""
    from pagedllm.kernels.attention_launch import unified_attention
    from pagedllm.kernels.block_copy import copy_blocks
    from pagedllm.kernels.kv_write import write_kv

    return unified_attention, write_kv, copy_blocks
