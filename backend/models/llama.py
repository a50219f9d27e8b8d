"""Native forward of the Llama family (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE, whose sparse layers run :class:`pagedllm.layers.moe.SparseMoeBlock`) over a paged KV cache.

Tokens of every scheduled sequence arrive as one flat batch; attention reads
and writes the cache only through the ``AttentionBackend`` and the step's
``AttentionMetadata``, planned once per step by the backend (``backend.plan``)
before the forward and shared by every layer. Projections are fused (q|k|v and gate|up) to cut kernel
launches; the loader concatenates the checkpoint's separate weights. Submodules are called through
``.forward``: ``nn.Module.__call__`` would look for hooks on each of a layer's seven calls, Python work
that adds up in a CPU decode step (RESULTS.md, issue 42), and nothing registers hooks on this model.

Under tensor parallelism (``tp.size > 1``) each rank builds the same modules at
its share's sizes (:mod:`pagedllm.distributed.sharding`): q|k|v and gate|up hold
its rows, o_proj and down_proj its columns, followed by one all-reduce each,
with their biases added once, after it; the embedding and the LM head hold its
vocabulary slice.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.attention.backends import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.kv_quant import LayerKvScales
from pagedllm.models.architectures import ArchitectureTraits
from pagedllm.layers.cpu_fused_ops import CpuFusedOps
from pagedllm.layers.norm_rotary import RMSNorm, RotaryEmbedding, apply_rotary, head_dim_of
from pagedllm.layers.moe import SparseMoeBlock, intermediate_layout
from pagedllm.layers.tensor_parallel import (ParameterSource, TensorPart, VocabParallelEmbedding, gather_vocab,
                                             model_shape)
from pagedllm.distributed.group import SINGLE, TensorParallel
from pagedllm.distributed.sharding import RowRange, ShardLayout, shard_layout


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    # The loader packs these for MKL or oneDNN on CPUs in float32 (pagedllm.layers.cpu_linear).
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.requires_grad_(False)
    return layer


def _bias(size: int, present: bool) -> nn.Parameter | None:
    return nn.Parameter(torch.empty(size), requires_grad=False) if present else None


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, traits: ArchitectureTraits, attention: AttentionBackend,
                 fused: CpuFusedOps | None, layout: ShardLayout, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.attention = attention
        self.qkv_proj = _linear(config.hidden_size, self.q_size + 2 * self.kv_size, traits.qkv_bias)
        # Row-parallel: the bias is added once, after the ranks' partial sums are reduced.
        self.o_proj = _linear(self.q_size, config.hidden_size, False)
        self.o_bias = _bias(config.hidden_size, traits.o_bias)
        self.tp = tp
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused) if traits.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused) if traits.qk_norm else None
        # Rotary in place on the fused q|k heads (after the per-head q/k norms, written back there, where a model
        # has them).
        self.fused_rotary = fused
        # An 8-bit KV cache's scales for this layer (pagedllm.attention.kv_quant), set by the engine; None otherwise.
        self.kv_scales: LayerKvScales | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        cos, sin = rope
        if self.fused_rotary is not None:
            if self.q_norm is not None and self.k_norm is not None:
                self._norm_heads_(qkv, self.q_norm, self.k_norm)
            self.fused_rotary.rotate_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
            attend_qkv = self.attention.attend_qkv
            if attend_qkv is not None and self.kv_scales is None:
                out = attend_qkv(qkv, *kv_cache, attn, self.scale, self.num_heads)
                if out is not None:
                    return self._output(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.fused_rotary is None:
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        k_cache, v_cache = kv_cache
        scales = self.kv_scales
        if scales is None:
            self.attention.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
            out = self.attention.attend(q, k_cache, v_cache, attn, self.scale)
        else:
            if scales.pending and attn.max_query_len > 1:  # calculate_kv_scales: the first prefill sets them
                scales.measure(k, v)
            self.attention.write_kv(k, v, k_cache, v_cache, attn.slot_mapping, scales.k, scales.v)
            out = self.attention.attend(q, k_cache, v_cache, attn, self.scale, scales.k, scales.v)
        return self._output(out.reshape(num_tokens, self.q_size))

    def _norm_heads_(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        """The per-head q and k norms (Qwen3), written back into the fused rows, so that the fused rotary and
        ``attend_qkv`` read them there as they do a model's without these norms."""
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        q.copy_(q_norm.forward(q.reshape(-1, self.head_dim)).view(q.shape))
        k.copy_(k_norm.forward(k.reshape(-1, self.head_dim)).view(k.shape))

    def _output(self, attended: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.o_proj.forward(attended))
        return out if self.o_bias is None else out.add_(self.o_bias)


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, traits: ArchitectureTraits, fused: CpuFusedOps | None,
                 layout: ShardLayout, tp: TensorParallel) -> None:
        super().__init__()
        self.intermediate_size = layout.intermediate_size
        self.gate_up_proj = _linear(config.hidden_size, 2 * self.intermediate_size, traits.mlp_bias)
        self.down_proj = _linear(self.intermediate_size, config.hidden_size, False)
        self.down_bias = _bias(config.hidden_size, traits.mlp_bias)
        self.tp = tp
        self.act_fn = ACT2FN[config.hidden_act]
        self.fused_silu = fused if config.hidden_act == "silu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.fused_silu is not None:
            hidden = self.fused_silu.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = self.act_fn(gate) * up
        out = self.tp.all_reduce(self.down_proj.forward(hidden))
        return out if self.down_bias is None else out.add_(self.down_bias)


def _feed_forward(config: PretrainedConfig, traits: ArchitectureTraits, fused: CpuFusedOps | None,
                  layout: ShardLayout, tp: TensorParallel, index: int) -> nn.Module:
    """Layer ``index``'s dense MLP, or its sparse MoE block (mixtures of experts, on their sparse layers)."""
    moe = traits.moe
    if moe is None or not moe.sparse_layers[index]:
        return MLP(config, traits, fused, layout, tp)
    shared = None
    if moe.shared_expert_intermediate_size:
        # No all-reduce of its own: the block reduces the shared and the routed experts' partial sums together.
        shared = MLP(config, traits, fused, intermediate_layout(layout, moe.shared_expert_intermediate_size,
                                                                "shared_expert_intermediate_size"), SINGLE)
    return SparseMoeBlock(config.hidden_size, moe, layout, tp, shared)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, traits: ArchitectureTraits, attention: AttentionBackend,
                 fused: CpuFusedOps | None, layout: ShardLayout, tp: TensorParallel, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, traits, attention, fused, layout, tp)
        self.mlp = _feed_forward(config, traits, fused, layout, tp, index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the previous layer's output is added to the stream here, not there,
        so that the add and the norm after it are one step (vLLM's layout). ``residual`` is ``None`` for the
        first layer, whose ``x`` is the embedding."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn.forward(h, rope, kv_cache, attn)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp.forward(h), residual


class Backbone(nn.Module):
    """Embedding, decoder stack and final norm: the checkpoint's ``model.*`` tensors."""

    def __init__(self, config: PretrainedConfig, traits: ArchitectureTraits, attention: AttentionBackend,
                 fused: CpuFusedOps | None, layout: ShardLayout, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, traits, attention, fused, layout, tp, index)
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)


class CausalLM(nn.Module):
    """One class for the whole Llama family; ``traits`` carry the differences.

    Parameter names follow the checkpoint's (``model.layers.0.self_attn...``)
    except for the fused ``qkv_proj`` and ``gate_up_proj``; see
    ``checkpoint_sources``. Build it on the meta device and let the loader
    assign real tensors. ``fused``: compiled elementwise steps for float32 or
    bf16 on a CPU (:mod:`pagedllm.layers.cpu_fused_ops`); ``None`` keeps torch ops.
    ``tp``: this process's rank in its tensor-parallel group; the model holds
    that rank's share (``num_heads``, ``num_kv_heads`` are per rank).
    ``ValueError`` when the group's size cannot split the model.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        traits: ArchitectureTraits,
        attention: AttentionBackend,
        device: torch.device,
        fused: CpuFusedOps | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.traits = traits
        self.attention = attention  # whose plan(metadata) the caller runs once per step
        self.tp = tp
        self.layout = shard_layout(model_shape(config), tp.rank, tp.size)
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = self.layout.num_heads
        self.num_kv_heads: int = self.layout.num_kv_heads
        self.head_dim: int = head_dim_of(config)
        self.vocab_size: int = config.vocab_size
        self.hidden_size: int = config.hidden_size
        self.sliding_window: int | None = traits.sliding_window
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = Backbone(config, traits, attention, fused, self.layout, tp)
        # None: the embedding's weight (tied), unless the loader packed a copy of it for the CPU.
        self.lm_head: nn.Module | None = (None if self.tie_word_embeddings
                                          else _linear(config.hidden_size, self.layout.vocab_per_rank, False))
        self.rotary = RotaryEmbedding(config, device)

    def checkpoint_sources(self) -> dict[str, ParameterSource]:
        """Each parameter's checkpoint tensors (this rank's rows of them), concatenated along dim 0 in order."""
        layout = self.layout
        sources: dict[str, ParameterSource] = {}
        for index, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock) and self.traits.moe is not None:
                sources.update(layer.mlp.checkpoint_sources(f"model.layers.{index}.mlp.",
                                                            f"model.layers.{index}.{self.traits.moe.block_name}."))
        for name, _ in self.named_parameters():
            if name in sources:
                continue
            prefix, _, leaf = name.rpartition(".")
            parts: tuple[TensorPart, ...]
            if prefix.endswith("qkv_proj"):
                base = prefix.removesuffix("qkv_proj")
                q, kv = layout.q_rows(), layout.kv_rows()
                parts = tuple(TensorPart(f"{base}{part}_proj.{leaf}", rows) for part, rows in zip("qkv", (q, kv, kv)))
            elif prefix.endswith("gate_up_proj"):
                base = prefix.removesuffix("gate_up_proj")
                parts = tuple(TensorPart(f"{base}{part}_proj.{leaf}", layout.mlp_rows()) for part in ("gate", "up"))
            elif name.endswith("o_bias"):
                parts = (TensorPart(name.removesuffix("o_bias") + "o_proj.bias"),)
            elif name.endswith("down_bias"):
                parts = (TensorPart(name.removesuffix("down_bias") + "down_proj.bias"),)
            else:
                parts = (TensorPart(name, self._rows_of(name)),)
            sources[name] = ParameterSource(parts)
        return sources

    def _rows_of(self, name: str) -> RowRange | None:
        """This rank's rows of a checkpoint tensor stored whole under the parameter's own name."""
        layout = self.layout
        if name.endswith("o_proj.weight"):
            return layout.o_columns()
        if name.endswith("down_proj.weight"):
            return layout.down_columns()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return layout.vocab_rows()
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flat batch; writes its K/V into ``kv_caches``."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers; the model has {self.num_layers}")
        self.require_context_fits(attn.max_seq_len)
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer.forward(x, residual, rope, kv_cache, attn)
        return self.model.norm.add_and_norm(x, residual)[0] if residual is not None else self.model.norm(x)

    def require_context_fits(self, max_seq_len: int) -> None:
        """``ValueError`` for a context this model cannot attend over (checked per step, graphs included)."""
        if self.sliding_window is not None and max_seq_len > self.sliding_window:
            raise ValueError(
                f"context of {max_seq_len} tokens exceeds the model's sliding_window={self.sliding_window}; "
                "sliding-window attention is not implemented, so cap max_model_len at the window"
            )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> float32 logits [N, vocab] on rank 0; ``None`` on the other ranks, which only send theirs."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        return gather_vocab(logits, self.tp, self.vocab_size)
