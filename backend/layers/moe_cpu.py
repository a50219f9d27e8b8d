"""The compiled CPU experts of the MoE block (``moe_experts.c``), built once per machine and loaded with ctypes.

The plain-torch twin of the fused kernel (:func:`pagedllm.kernels.fused_moe_reference.fused_moe_ref`)
pays a few torch ops per expert called: a GEMM, slices, SiLU, a product. A
decode step of a few dozen tokens calls nearly every expert with a handful of
rows each, so at small shapes those ops, not the arithmetic, set the block's
time. The compiled routine runs the whole routed-expert computation (grouping,
both GEMMs, SiLU-and-multiply, the weighted sum) in one call, float32 only, on
weights packed once per block (:func:`pack_experts`: panels of 8 output columns
that its products stream through in order; the block then empties its expert
parameters, so the packed weights are the only copy). The reference stays its oracle (tests/test_moe_cpu.py)
and runs wherever the routine does not apply. How it is built and cached: :mod:`pagedllm.platform.native_build`.

Without a compiler, or with ``PAGEDLLM_NATIVE_MOE=0``, :func:`load_native_moe`
returns ``None`` and the reference runs instead, with a warning saying why.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.kernels.fused_moe_reference import validate_moe_inputs
from pagedllm.platform.native_build import CACHE_ENV, load_library

__all__ = ["CACHE_ENV", "NativeMoe", "PackedExperts", "SWITCH_ENV", "load_native_moe", "pack_experts"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("moe_experts.c")
SWITCH_ENV = "PAGEDLLM_NATIVE_MOE"  # "0": never build or load it


@dataclass(frozen=True, slots=True)
class PackedExperts:
    """A block's stacked expert weights laid out for the routine: panels of 8 output columns, each ``[in, 8]``.

    gate|up as ``[E, ceil(2I / 8), H, 8]``, down as ``[E, ceil(H / 8), I, 8]``, zero past the last column.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    num_experts: int
    hidden_size: int
    inter: int


def pack_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> PackedExperts:
    """``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]`` (float32, CPU) packed for :meth:`NativeMoe.run`."""
    num_experts, double_inter, hidden_size = w_gate_up.shape
    return PackedExperts(_panels(w_gate_up), _panels(w_down), num_experts, hidden_size, double_inter // 2)


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` -> ``[E, ceil(N / 8), K, 8]``: each panel's rows hold 8 consecutive outputs' weights."""
    experts, outputs, inputs = weight.shape
    padded = torch.zeros(experts, -(-outputs // 8) * 8, inputs, dtype=torch.float32)
    padded[:, :outputs] = weight
    return padded.view(experts, -1, 8, inputs).transpose(2, 3).contiguous()


class NativeMoe:
    """``pagedllm_moe_experts_f32`` with its argument types; the contract is in ``moe_experts.c``."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._function = library.pagedllm_moe_experts_f32
        self._function.restype = ctypes.c_int
        self._function.argtypes = [pointer, i64, i64, i64, pointer, pointer, i64, i64, pointer, pointer, i64, pointer,
                                   pointer, pointer, pointer, ctypes.c_int]

    @staticmethod
    def applies(hidden: torch.Tensor, w_gate_up: torch.Tensor) -> bool:
        """Whether these inputs are the routine's: float32 on the CPU."""
        return hidden.device.type == "cpu" and hidden.dtype == torch.float32 and w_gate_up.dtype == torch.float32

    def __call__(
        self,
        hidden: torch.Tensor,  # float32 [num_tokens, hidden_size]
        w_gate_up: torch.Tensor,  # float32 [num_experts, 2 * intermediate, hidden_size]: gate rows, then up rows
        w_down: torch.Tensor,  # float32 [num_experts, hidden_size, intermediate]
        topk_weights: torch.Tensor,  # [num_tokens, top_k]
        topk_ids: torch.Tensor,  # int [num_tokens, top_k]
    ) -> torch.Tensor:
        """:func:`~pagedllm.kernels.fused_moe_reference.fused_moe_ref`'s result, up to float32 rounding.

        Packs the weights on every call: the MoE block packs once and calls :meth:`run`.
        """
        validate_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids)
        if not self.applies(hidden, w_gate_up) or w_down.dtype != torch.float32:
            raise ValueError(f"the compiled MoE experts take float32 CPU tensors, got hidden {hidden.dtype} on "
                             f"{hidden.device}, w_gate_up {w_gate_up.dtype}, w_down {w_down.dtype}")
        return self.run(hidden, pack_experts(w_gate_up, w_down), topk_weights, topk_ids)

    def run(self, hidden: torch.Tensor, experts: PackedExperts, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for ``hidden`` (float32 CPU ``[T, H]``) under the routing."""
        num_tokens = hidden.shape[0]
        # C trusts these: a mismatch would read outside the tensors instead of raising.
        if (hidden.dtype != torch.float32 or hidden.device.type != "cpu" or hidden.dim() != 2
                or hidden.shape[1] != experts.hidden_size or topk_ids.dim() != 2
                or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape):
            raise ValueError(f"hidden {hidden.dtype} {tuple(hidden.shape)} on {hidden.device}, topk_weights "
                             f"{tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} do not fit float32 "
                             f"CPU experts of width {experts.hidden_size}")
        # C reads the routing as dense arrays (held until the call returns).
        weights = topk_weights.to(torch.float32).contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        if hidden.stride(1) != 1:
            hidden = hidden.contiguous()
        out = torch.empty(num_tokens, experts.hidden_size, dtype=torch.float32)
        if num_tokens == 0:
            return out
        choices = ids.numel()
        # The gate|up products of every grouped row (then, in their gate half, the activations); order, starts.
        gate_up = torch.empty(choices, 2 * experts.inter, dtype=torch.float32)
        ints = torch.empty(choices + experts.num_experts + 1, dtype=torch.int64)
        failed = self._function(hidden.data_ptr(), num_tokens, experts.hidden_size, hidden.stride(0),
                                experts.gate_up.data_ptr(), experts.down.data_ptr(), experts.num_experts,
                                experts.inter, weights.data_ptr(), ids.data_ptr(), ids.shape[1], out.data_ptr(),
                                gate_up.data_ptr(), ints.data_ptr(), ints.data_ptr() + 8 * choices,
                                torch.get_num_threads())
        if failed:
            raise ValueError(f"topk_ids holds expert ids outside [0, {experts.num_experts})")
        return out


@functools.cache
def load_native_moe() -> NativeMoe | None:
    """The compiled routine, built on first call; ``None`` (with one warning) when it cannot be."""
    library = load_library(SOURCE, SWITCH_ENV, "CPU MoE experts run the slower plain-torch path", logger)
    return None if library is None else NativeMoe(library)
