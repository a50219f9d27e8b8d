"""Chooses which paged-attention kernels a model runs: Triton-lang or plain torch."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.kernels.reference import copy_blocks_ref, unified_attention_ref, write_kv_ref

# Set to "1" to run the Triton-lang kernels even on CPU (with TRITON_INTERPRET=1).
FORCE_TRITON_ENV = "PAGEDLLM_FORCE_TRITON"


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The three cache operations a model's attention layers need."""

    name: str
    unified_attention: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]
    copy_blocks: Callable[..., None]


REFERENCE_BACKEND = AttentionBackend("torch-reference", unified_attention_ref, write_kv_ref, copy_blocks_ref)


def select_attention_backend(device: torch.device, use_triton: bool | None = None) -> AttentionBackend:
    """Triton kernels on CUDA, torch references on CPU, unless told otherwise.

    ``use_triton=None`` follows the device and the ``PAGEDLLM_FORCE_TRITON`` switch.
    """
    if use_triton is None:
        use_triton = device.type == "cuda" or os.environ.get(FORCE_TRITON_ENV) == "1"
    if not use_triton:
        return REFERENCE_BACKEND
    from pagedllm.kernels import triton_backend_ops

    return AttentionBackend("triton", *triton_backend_ops())
