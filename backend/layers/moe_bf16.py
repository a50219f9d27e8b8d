"""The compiled bf16 CPU experts of the MoE block (``moe_experts_bf16.c``): every routed expert in one call.

Through oneDNN (:mod:`pagedllm.layers.moe_onednn`) a step pays two GEMM calls per chosen expert and torch's
grouping, gather, SiLU, weighting and scatter around them; the compiled routine does all of it in one call per
block, on AMX tiles where the process may use them and with avx512_bf16's ``vdpbf16ps`` elsewhere, on weights
packed once as AMX B tiles (:func:`pack_tiles`). Products accumulate in float32; the activations and the output
round to bf16 once each, where the reference rounds after every op, so results agree with
:func:`pagedllm.kernels.fused_moe_reference.fused_moe_ref` within bf16 rounding (``tests/test_moe_bf16.py``).

Without a compiler, on a CPU without avx512_bf16, or with ``PAGEDLLM_NATIVE_MOE=0``, :func:`load_native_moe_bf16`
returns ``None`` and the block runs its experts on oneDNN instead.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedllm.layers.moe_cpu import SWITCH_ENV
from pagedllm.platform.native_build import load_library

__all__ = ["Bf16Experts", "KERNELS", "NativeMoeBf16", "load_native_moe_bf16", "pack_tiles"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("moe_experts_bf16.c")
KERNELS = {"vec": 1, "amx": 2}  # the routine's kernel flags, the preferred last
TILE_N, TILE_K = 16, 32  # an AMX B tile: 16 output columns by 32 inputs
SPARE_ROWS = 32  # the routine reads up to one product's rows past the last grouped row


def pack_tiles(weight: torch.Tensor, outputs: int, inputs: int) -> torch.Tensor:
    """``weight [E, N, K]`` zero-padded to ``[E, outputs, inputs]`` (multiples of 16 and 32) and laid out as
    ``[E, outputs / 16, inputs / 32, 512]``: per block of 16 outputs, its tiles in input order, each tile 16 rows
    of [16 outputs x 2 consecutive inputs] (an AMX B tile; each row is one ``vdpbf16ps`` operand)."""
    experts, n, k = weight.shape
    if outputs % TILE_N or inputs % TILE_K or outputs < n or inputs < k:
        raise ValueError(f"cannot pad [{n}, {k}] weights to [{outputs}, {inputs}] tiles of {TILE_N} x {TILE_K}")
    padded = weight.new_zeros(experts, outputs, inputs)
    padded[:, :n, :k] = weight
    tiles = padded.view(experts, outputs // TILE_N, TILE_N, inputs // TILE_K, TILE_K // 2, 2)
    return tiles.permute(0, 1, 3, 4, 2, 5).reshape(experts, outputs // TILE_N, inputs // TILE_K, -1).contiguous()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class NativeMoeBf16:
    """``pagedllm_moe_experts_bf16`` with its argument types and the kernels this process can run."""

    def __init__(self, library: ctypes.CDLL, kernels: frozenset[str]) -> None:
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self.kernels = kernels
        self.preferred = max(kernels, key=KERNELS.__getitem__)
        self._function = library.pagedllm_moe_experts_bf16
        self._function.restype = ctypes.c_int
        self._function.argtypes = [pointer, i64, i64, i64, pointer, pointer, i64, i64, i64, i64, pointer, pointer,
                                   i64, pointer, pointer, pointer, pointer, pointer, pointer, ctypes.c_int,
                                   ctypes.c_int]

    def call(self, experts: Bf16Experts, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             kernel: str) -> torch.Tensor:
        """The routine on checked, dense arguments (``Bf16Experts.__call__`` checks them)."""
        num_tokens, choices = hidden.shape[0], ids.numel()
        out = torch.empty(num_tokens, experts.hidden_size, dtype=torch.bfloat16)
        if num_tokens == 0:
            return out
        grouped = torch.empty(choices + SPARE_ROWS, experts.k_padded, dtype=torch.bfloat16)
        act = torch.empty(choices + SPARE_ROWS, experts.inter_padded, dtype=torch.bfloat16)
        sums = torch.empty(num_tokens, experts.hidden_padded, dtype=torch.float32)
        ints = torch.empty(choices + experts.num_experts + 1, dtype=torch.int64)
        failed = self._function(hidden.data_ptr(), num_tokens, experts.hidden_size, hidden.stride(0),
                                experts.gate_up.data_ptr(), experts.down.data_ptr(), experts.num_experts,
                                experts.inter_padded, experts.hidden_padded, experts.k_padded, weights.data_ptr(),
                                ids.data_ptr(), ids.shape[1], out.data_ptr(), grouped.data_ptr(), act.data_ptr(),
                                sums.data_ptr(), ints.data_ptr(), ints.data_ptr() + 8 * choices, KERNELS[kernel],
                                torch.get_num_threads())
        if failed == -1:
            raise ValueError(f"topk_ids holds expert ids outside [0, {experts.num_experts})")
        if failed:
            raise RuntimeError(f"the compiled bf16 MoE routine cannot run its {kernel!r} kernel here")
        return out


class Bf16Experts:
    """A block's stacked bf16 experts, ``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]``, packed for the routine."""

    def __init__(self, routine: NativeMoeBf16, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        if w_gate_up.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16:
            raise ValueError(f"bf16 experts need bf16 weights, got {w_gate_up.dtype} and {w_down.dtype}")
        self.routine = routine
        self.num_experts, double_inter, self.hidden_size = w_gate_up.shape
        inter = double_inter // 2
        self.k_padded = _round_up(self.hidden_size, TILE_K)
        self.inter_padded = _round_up(inter, TILE_K)
        self.hidden_padded = _round_up(self.hidden_size, 2 * TILE_N)
        # Gate and up tiles of each 16-column block side by side: one task reads both halves of its activations.
        gate = pack_tiles(w_gate_up[:, :inter], self.inter_padded, self.k_padded)
        up = pack_tiles(w_gate_up[:, inter:], self.inter_padded, self.k_padded)
        self.gate_up = torch.stack((gate, up), dim=2).contiguous()
        self.down = pack_tiles(w_down, self.hidden_padded, self.inter_padded)

    @staticmethod
    def applies(hidden: torch.Tensor, w_gate_up: torch.Tensor) -> bool:
        """Whether these inputs are the routine's: bf16 on the CPU."""
        return hidden.device.type == "cpu" and hidden.dtype == w_gate_up.dtype == torch.bfloat16

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 kernel: str | None = None) -> torch.Tensor:
        """The routed experts' weighted sum for ``hidden [T, H]`` (bf16) under the routing ``[T, top_k]``, by
        ``kernel`` (one of the routine's ``kernels``; its preferred one by default)."""
        kernel = kernel or self.routine.preferred
        if kernel not in self.routine.kernels:
            raise ValueError(f"kernel {kernel!r} is not one of this CPU's {sorted(self.routine.kernels)}")
        # C trusts these: a mismatch would read outside the tensors instead of raising.
        if (hidden.dtype != torch.bfloat16 or hidden.device.type != "cpu" or hidden.dim() != 2
                or hidden.shape[1] != self.hidden_size or topk_ids.dim() != 2
                or topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape):
            raise ValueError(f"hidden {hidden.dtype} {tuple(hidden.shape)} on {hidden.device}, topk_weights "
                             f"{tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} do not fit bf16 "
                             f"CPU experts of width {self.hidden_size}")
        if hidden.stride(1) != 1:
            hidden = hidden.contiguous()
        # C reads the routing as dense arrays (held until the call returns).
        weights = topk_weights.to(torch.float32).contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        return self.routine.call(self, hidden, weights, ids, kernel)


@functools.cache
def load_native_moe_bf16() -> NativeMoeBf16 | None:
    """The compiled routine, built on first call; ``None`` where it cannot be built (one warning) or this CPU
    has no bf16 products for it (avx512_bf16 or AMX)."""
    library = load_library(SOURCE, SWITCH_ENV, "bf16 CPU MoE experts run on oneDNN", logger)
    if library is None:
        return None
    flags = library.pagedllm_moe_bf16_kernels()
    kernels = frozenset(name for name, flag in KERNELS.items() if flags & flag)
    if not kernels:
        logger.info("this CPU has no avx512_bf16: bf16 CPU MoE experts run on oneDNN")
        return None
    return NativeMoeBf16(library, kernels)
