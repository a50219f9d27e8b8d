"""Chooses which paged-attention implementation a model runs, and gives them one interface.

A step goes: the runner builds ``AttentionMetadata``, calls ``backend.plan`` on
it exactly once, and every layer passes the planned metadata to
``backend.attend``. Planning is where a backend does its per-step work (index
math, masks, launch tiles), so no layer repeats it.

Backends by name:

* ``torch`` — :mod:`pagedllm.attention.cpu_attention`, the production plain-torch path (the CPU default);
* ``triton`` — the Triton-lang kernels (the CUDA default; on CPU they run in triton's interpreter);
* ``torch-reference`` — the kernels' test oracle, :func:`pagedllm.kernels.reference.unified_attention_ref`.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pagedllm.kernels.reference import copy_blocks_ref, unified_attention_ref, write_kv_ref
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.cpu_attention import CpuPagedAttention, new_cpu_cache
from pagedllm.attention.cpu_attention_plan import plan_cpu_attention
from pagedllm.attention.native_decode import load_native_decode
from pagedllm.attention.native_prefill import load_native_prefill
from pagedllm.attention.native_prefill_bf16 import load_native_prefill_bf16

# Set to "1" to run the Triton-lang kernels even on CPU (with TRITON_INTERPRET=1).
FORCE_TRITON_ENV = "PAGEDLLM_FORCE_TRITON"

# attend(q, k_cache, v_cache, planned metadata, scale, k_scale=None, v_scale=None) -> [num_tokens, num_heads, head_dim];
# k_scale/v_scale: an 8-bit cache's per-layer scales (fp32 [1]), which write_kv takes after slot_mapping too.
Attend = Callable[..., torch.Tensor]
# new_cache((num_blocks, block_size, num_kv_heads, head_dim), dtype, device) -> a zeroed cache of that shape
NewCache = Callable[[tuple[int, int, int, int], torch.dtype, torch.device], torch.Tensor]


def _new_contiguous_cache(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The per-step plan and the cache operations a model's attention layers need.

    Every backend sees caches as ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    ``new_cache`` chooses how that is laid out in memory.
    """

    name: str
    plan: Callable[[AttentionMetadata], AttentionMetadata]  # pure; returns the metadata with this backend's plan
    attend: Attend
    write_kv: Callable[..., None]
    copy_blocks: Callable[..., None]
    new_cache: NewCache = _new_contiguous_cache
    # attend_qkv(qkv, k_cache, v_cache, planned metadata, scale, num_heads) -> [num_tokens, num_heads * head_dim] or
    # None: write_kv and attend in one from a layer's fused, rotated q|k|v rows, for the steps the backend has a
    # faster way for (CpuPagedAttention.attend_qkv); None for a step that takes the two calls.
    attend_qkv: Callable[..., torch.Tensor | None] | None = None


def _attend_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                      scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    return unified_attention_ref(q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens,
                                 metadata.block_table, scale, k_scale=k_scale, v_scale=v_scale)


def _unplanned(metadata: AttentionMetadata) -> AttentionMetadata:
    """The oracle redoes its layout work in every call, on purpose: it stays simple and independent."""
    return metadata


REFERENCE_BACKEND = AttentionBackend("torch-reference", _unplanned, _attend_reference, write_kv_ref, copy_blocks_ref)
BACKEND_NAMES = ("torch", "triton", "torch-reference")


def torch_backend(native: bool = True) -> AttentionBackend:
    """The production CPU backend; each one owns its own reusable gather buffers.

    ``native`` runs float32 and bf16 decodes, and the float32 prefill chunks it is faster for, in the compiled
    routines when they can be built (:mod:`pagedllm.attention.native_decode`,
    :mod:`pagedllm.attention.native_prefill`), and bf16 prefill chunks in the AMX routine where the CPU has it
    (:mod:`pagedllm.attention.native_prefill_bf16`); ``False`` keeps every step in plain torch.
    """
    attention = CpuPagedAttention(load_native_decode() if native else None, load_native_prefill() if native else None,
                                  load_native_prefill_bf16() if native else None)
    return AttentionBackend("torch", plan_cpu_attention, attention.attend, attention.write_kv, copy_blocks_ref,
                            new_cpu_cache, attention.attend_qkv)


def triton_backend() -> AttentionBackend:
    """The Triton-lang kernels: the plan checks the layout once, the first layer plans the launch."""
    from pagedllm.kernels import triton_backend_ops
    from pagedllm.kernels.attention_launch import plan_unified_attention, unified_attention_planned

    _, write_kv, copy_blocks = triton_backend_ops()

    def plan(metadata: AttentionMetadata) -> AttentionMetadata:
        step = plan_unified_attention(metadata.query_start_loc, metadata.seq_lens, metadata.block_table)
        return replace(metadata, plan=step)

    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        return unified_attention_planned(q, k_cache, v_cache, metadata.plan, scale, k_scale=k_scale, v_scale=v_scale)

    return AttentionBackend("triton", plan, attend, write_kv, copy_blocks)


def attention_backend_named(name: str) -> AttentionBackend:
    """One of :data:`BACKEND_NAMES`; ``ValueError`` naming the choices otherwise."""
    if name == "torch":
        return torch_backend()
    if name == "triton":
        return triton_backend()
    if name == "torch-reference":
        return REFERENCE_BACKEND
    raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKEND_NAMES)}")


def select_attention_backend(device: torch.device, use_triton: bool | None = None) -> AttentionBackend:
    """Triton kernels on CUDA, the plain-torch backend on CPU, unless told otherwise.

    ``use_triton=None`` follows the device and the ``PAGEDLLM_FORCE_TRITON`` switch.
    """
    if use_triton is None:
        use_triton = device.type == "cuda" or os.environ.get(FORCE_TRITON_ENV) == "1"
    return triton_backend() if use_triton else torch_backend()
