"""Building blocks shared by the Llama family, written to match transformers' arithmetic.

Token-exact greedy output against transformers in float32 depends on doing the
same operations in the same order (RMSNorm in float32 then cast back, rotary
tables computed in float32 then cast, ``rotate_half``), so these mirror
``transformers.models.llama.modeling_llama`` step for step.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedllm.layers.cpu_fused_ops import CpuFusedOps

# These rope types recompute their frequencies from the running sequence length;
# one batch mixes sequences of many lengths, so they cannot share one table.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled in the input dtype.

    With ``fused`` (a CPU model's compiled ops), [tokens, size] inputs of a dtype it norms (float32, and bf16
    where it reproduces torch's bf16 norm: :attr:`CpuFusedOps.norm_dtypes`) take one compiled call instead of
    six to nine ops; other dtypes keep torch's.
    """

    def __init__(self, size: int, eps: float, fused: CpuFusedOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.fused = fused

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: a layer's skip connection and the norm after it.

        The fused path adds into ``residual`` in place and returns it.
        """
        weight = self.weight  # read once: a module's parameter is looked up by nn.Module.__getattr__, in Python
        fused = self._fused_for(x, weight)
        if fused is not None:
            return fused.rms_norm(x, residual, weight, self.eps), residual
        residual = residual + x
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        fused = self._fused_for(x, weight)
        if fused is not None:
            return fused.rms_norm(x, None, weight, self.eps)
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return weight * x.to(input_dtype)

    def _fused_for(self, x: torch.Tensor, weight: torch.Tensor) -> CpuFusedOps | None:
        """The compiled ops, when they norm ``x``'s dtype (and the weight is of it)."""
        fused = self.fused
        return fused if fused is not None and x.dtype == weight.dtype and x.dtype in fused.norm_dtypes else None


def head_dim_of(config: PretrainedConfig) -> int:
    """The per-head width: explicit ``head_dim`` when the config has one."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inverse_frequencies(config: PretrainedConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and output scaling from the config's ``rope_parameters``.

    Scaled variants (linear, llama3, yarn, ...) come from transformers' own
    ``ROPE_INIT_FUNCTIONS``; the default rope is the one formula transformers
    keeps inside each model class.
    """
    parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", "default")
    if rope_type == "default":
        dim = head_dim_of(config)
        base = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        return 1.0 / (base**exponents), 1.0
    if rope_type in _LENGTH_DEPENDENT_ROPE or rope_type not in ROPE_INIT_FUNCTIONS:
        supported = sorted({"default", *ROPE_INIT_FUNCTIONS} - set(_LENGTH_DEPENDENT_ROPE))
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported; supported: {supported}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return inv_freq.to(device=device, dtype=torch.float), float(scaling)


# A model whose every position's cos and sin fit in this many values each keeps them as tables and looks a
# batch's rows up (one index_select each) instead of computing them (about ten ops): a fixed cost per forward
# that a small model's forward, a speculative draft's, pays k times a step. Longer contexts compute them per call.
MAX_ROTARY_TABLE_VALUES = 1 << 20


class RotaryEmbedding:
    """Cos/sin tables for arbitrary token positions of a flat batch."""

    def __init__(self, config: PretrainedConfig, device: torch.device) -> None:
        # Its own device scope: the model around it may be under construction on "meta".
        with torch.device(device):
            self.inv_freq, self.scaling = rope_inverse_frequencies(config, device)
        positions = getattr(config, "max_position_embeddings", None)
        # The engine keeps every position below max_position_embeddings (max_model_len may not exceed it).
        fits = positions is not None and positions * 2 * self.inv_freq.numel() <= MAX_ROTARY_TABLE_VALUES
        self._table_positions: int | None = positions if fits else None
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # built on first use of a dtype

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64 [num_tokens] -> (cos, sin), each [num_tokens, 1, head_dim]."""
        if self._table_positions is None:
            return self._compute(positions, dtype)
        tables = self._tables.get(dtype)
        if tables is None:
            # Elementwise, so each row is what computing its position alone gives.
            every = torch.arange(self._table_positions, device=self.inv_freq.device)
            tables = self._tables[dtype] = self._compute(every, dtype)
        return tables[0].index_select(0, positions), tables[1].index_select(0, positions)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [num_tokens, num_heads, head_dim] by its tokens' angles."""
    return (x * cos) + (rotate_half(x) * sin)
