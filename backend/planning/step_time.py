"""How long one engine step takes: a roofline over its bytes and FLOPs, plus fixed costs.

    seconds = overhead + per_seq × sequences + max(bytes × s_per_byte, FLOPs × s_per_flop)

A step reads every weight once (of a mixture of experts, only the experts its
tokens chose) and the K/V of every scheduled sequence's context (``bytes``); it
multiplies each scheduled token through the layers, the LM head only for the
sampled rows, and attends each query token to its context (``FLOPs``).
``overhead`` is what a step costs whatever its size (Python scheduling, kernel
launches); ``per_seq`` what each sequence adds to it (input building,
sampling, detokenizing).

Uncalibrated, the coefficients come from the accelerator's data sheet at
achievable fractions of peak; ``fit`` replaces them with least-squares values
from timed engine steps (``calibrate``).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.planning.gpu_catalog import Accelerator
from pagedllm.planning.kv_math import DTYPE_BYTES, kv_bytes_per_token, kv_heads_per_gpu, weights_bytes_per_gpu
from pagedllm.planning.model_catalog import ModelSpec, expected_experts_touched

# Achievable shares of the data-sheet peaks for a well-tuned decode (bandwidth) and prefill (tensor cores).
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
DEFAULT_FLOPS_EFFICIENCY = 0.6
# A Python engine without CUDA graphs: ~12 kernel launches per layer plus scheduling, about 4 ms a step.
DEFAULT_STEP_OVERHEAD_S = 4e-3
DEFAULT_PER_SEQ_S = 2e-5


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one scheduled step asks of the hardware."""

    num_seqs: int
    num_tokens: int
    num_sampled: int
    kv_tokens_read: int  # context of every scheduled sequence, this step's tokens included
    attention_pairs: int  # (query token, key token) pairs attended, causal

    @classmethod
    def of(cls, step: SchedulerOutput) -> StepShape:
        """Shape of a step that has run: its tokens are counted in each sequence's ``num_computed_tokens``."""
        kv = pairs = 0
        for item in step.scheduled:
            end, q = item.seq.num_computed_tokens, item.num_tokens
            kv += end
            pairs += q * end - q * (q - 1) // 2
        # Logits are computed once per completing sequence: forked siblings and beams reuse their rows.
        rows = set(step.sample_logit_rows).union(*(batch.logit_rows for batch in step.beams))
        return cls(len(step.scheduled), step.num_tokens, len(rows), kv, pairs)


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Bytes and FLOPs per unit of a step, for one model on one GPU of its tensor-parallel group."""

    weights_bytes: int  # all of them (memory)
    kv_bytes_per_token: int
    flops_per_token: int  # every matmul of the decoder layers (a mixture of experts: the chosen experts only)
    flops_per_sampled: int  # the LM head, computed for sampled rows only
    flops_per_pair: int  # QK^T and PV over all heads and layers
    # A mixture of experts reads only the experts its step's tokens chose (ModelSpec.experts_touched).
    expert_bytes: int = 0  # one expert of every sparse layer
    num_experts: int = 0
    experts_per_token: int = 0

    @classmethod
    def of(cls, model: ModelSpec, dtype: str, kv_dtype: str, tensor_parallel_size: int = 1) -> ModelCost:
        tp = tensor_parallel_size
        kv_width = kv_heads_per_gpu(model, tp) * model.head_dim
        q_width = model.num_heads * model.head_dim // tp
        attention = model.num_layers * (2 * model.hidden_size * q_width + 2 * model.hidden_size * kv_width)
        active_mlp = model.mlp_params - model.idle_expert_params
        return cls(
            weights_bytes=weights_bytes_per_gpu(model, dtype, tp),
            kv_bytes_per_token=kv_bytes_per_token(model, kv_dtype, tp),
            flops_per_token=2 * (attention + active_mlp // tp),
            flops_per_sampled=2 * model.hidden_size * model.vocab_size // tp,
            flops_per_pair=4 * model.num_layers * q_width,
            expert_bytes=model.num_sparse_layers * model.expert_params // tp * DTYPE_BYTES[dtype],
            num_experts=model.num_experts,
            experts_per_token=model.experts_per_token,
        )

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes a step of ``num_tokens`` reads: all of a dense model; a mixture of experts skips the
        experts none of its tokens chose (expected count for independent, uniform routing)."""
        touched = expected_experts_touched(self.num_experts, self.experts_per_token, num_tokens)
        return self.weights_bytes - self.expert_bytes * (self.num_experts - touched)

    def bytes(self, shape: StepShape) -> float:
        return self.weight_bytes_read(shape.num_tokens) + self.kv_bytes_per_token * shape.kv_tokens_read

    def flops(self, shape: StepShape) -> float:
        return (self.flops_per_token * shape.num_tokens + self.flops_per_sampled * shape.num_sampled
                + self.flops_per_pair * shape.attention_pairs)


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    overhead_s: float
    per_seq_s: float
    s_per_byte: float
    s_per_flop: float
    source: str  # "H200 data sheet", "calibrated on cpu (…)"

    @classmethod
    def from_accelerator(cls, gpu: Accelerator) -> StepTimeModel:
        return cls(DEFAULT_STEP_OVERHEAD_S, DEFAULT_PER_SEQ_S,
                   1.0 / (gpu.bandwidth_bytes_per_s * DEFAULT_BANDWIDTH_EFFICIENCY),
                   1.0 / (gpu.flops_per_s * DEFAULT_FLOPS_EFFICIENCY), f"{gpu.name} data sheet (uncalibrated)")

    def seconds(self, cost: ModelCost, shape: StepShape) -> float:
        roofline = max(cost.bytes(shape) * self.s_per_byte, cost.flops(shape) * self.s_per_flop)
        return self.overhead_s + self.per_seq_s * shape.num_seqs + roofline

    @property
    def bandwidth_gbs(self) -> float | None:
        """Effective bandwidth in GB/s; None when no timed step was bound by bytes."""
        return None if self.s_per_byte == 0 else 1e-9 / self.s_per_byte

    @property
    def tflops(self) -> float | None:
        return None if self.s_per_flop == 0 else 1e-12 / self.s_per_flop

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bandwidth_gbs": self.bandwidth_gbs, "tflops": self.tflops}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepTimeModel:
        return cls(data["overhead_s"], data["per_seq_s"], data["s_per_byte"], data["s_per_flop"], data["source"])


def fit(samples: Seq[tuple[StepShape, ModelCost, float]], source: str) -> StepTimeModel:
    """Least-squares coefficients (all >= 0) for timed steps.

    Absolute errors, so the fitted steps add up to the measured total (what a
    wall-time prediction needs). The max() makes the model piecewise linear:
    the first fit adds both terms, then each step is assigned to the bound
    (bytes or FLOPs) that dominates under the current fit and the linear
    problem is solved again, until the assignment stops changing.
    """
    if len(samples) < 4:
        raise ValueError(f"calibration needs at least 4 timed steps, got {len(samples)}")
    seqs = np.array([s.num_seqs for s, _, _ in samples], dtype=float)
    nbytes = np.array([c.bytes(s) for s, c, _ in samples], dtype=float)
    nflops = np.array([c.flops(s) for s, c, _ in samples], dtype=float)
    seconds = np.array([t for _, _, t in samples], dtype=float)
    memory_bound = np.ones(len(samples), dtype=bool)
    compute_bound = np.ones(len(samples), dtype=bool)
    coef = np.zeros(4)
    for _ in range(20):
        columns = np.stack([np.ones_like(seqs), seqs, nbytes * memory_bound, nflops * compute_bound], axis=1)
        coef = _nonnegative_least_squares(columns, seconds)
        assignment = nbytes * coef[2] >= nflops * coef[3]
        if np.array_equal(assignment, memory_bound) and np.array_equal(~assignment, compute_bound):
            break
        memory_bound, compute_bound = assignment, ~assignment
    return StepTimeModel(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), source)


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact NNLS for a handful of columns: the best unconstrained fit over every subset of them."""
    best, best_residual = np.zeros(a.shape[1]), float(np.linalg.norm(b))
    for mask in itertools.product((False, True), repeat=a.shape[1]):
        columns = np.flatnonzero(mask)
        if columns.size == 0 or not a[:, columns].any():
            continue
        solution = np.linalg.lstsq(a[:, columns], b, rcond=None)[0]
        if (solution < 0).any():
            continue
        coef = np.zeros(a.shape[1])
        coef[columns] = solution
        residual = float(np.linalg.norm(a @ coef - b))
        if residual < best_residual:
            best, best_residual = coef, residual
    return best
