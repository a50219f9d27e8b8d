"""Wrap a loaded ``CausalLM``'s linears with LoRA slots, and copy an adapter into a slot following its TP layout.

q|k|v and gate|up are column-parallel: a rank's ``B`` rows are the same rows of q, k, v (gate, up) that its base
weight holds, and ``A`` is whole. o_proj and down_proj are row-parallel: a rank's ``A`` columns are its base
weight's input columns and ``B`` is whole; their LoRA term is added before the layer's all-reduce (the wrapper sits
inside it), so the ranks' partial products sum to the whole. The rules come from :mod:`pagedllm.distributed.sharding`.
"""
from __future__ import annotations

import torch

from pagedllm.lora.adapter import LoRAAdapter, LoRAWeights
from pagedllm.lora.adapter_files import base_model_shape
from pagedllm.lora.linear import LoRAContext, LoRALinear
from pagedllm.models import CausalLM
from pagedllm.distributed.sharding import RowRange, ShardLayout

Part = tuple[torch.Tensor, torch.Tensor]  # (A [rank, in], B [out, rank]) of one part of a fused linear


class AdaptedModel:
    """The model's adapted linears and the step context they read; ``load(slot, adapter)`` fills a slot."""

    def __init__(self, model: CausalLM, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.context = LoRAContext()
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        device = model.model.norm.weight.device
        moe = base_model_shape(model.config.to_dict()).moe

        def wrap(base: torch.nn.Module, parts: tuple[int, ...]) -> LoRALinear:
            return LoRALinear(base, parts, max_loras, max_rank, self.context, dtype, device)

        for layer in model.model.layers:
            attn = layer.self_attn
            attn.qkv_proj = wrap(attn.qkv_proj, (attn.q_size, attn.kv_size, attn.kv_size))
            attn.o_proj = wrap(attn.o_proj, (attn.o_proj.out_features,))
            mlp = layer.mlp
            if not moe:  # adapters of a mixture-of-experts model adapt attention only (pagedllm.lora.adapter)
                mlp.gate_up_proj = wrap(mlp.gate_up_proj, (mlp.intermediate_size, mlp.intermediate_size))
                mlp.down_proj = wrap(mlp.down_proj, (mlp.down_proj.out_features,))

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        for index, layer in enumerate(self.model.model.layers):
            parts = layer_parts(adapter, index, self.model.layout)
            attn, mlp = layer.self_attn, layer.mlp
            linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj,
                       "gate_up_proj": getattr(mlp, "gate_up_proj", None), "down_proj": getattr(mlp, "down_proj", None)}
            for name, linear in linears.items():
                if isinstance(linear, LoRALinear):
                    linear.set_slot(slot, parts[name], adapter.scale)


def layer_parts(adapter: LoRAAdapter, index: int, layout: ShardLayout) -> dict[str, list[Part | None]]:
    """This rank's ``(A, B)`` of each fused linear's parts in layer ``index`` (``None`` where none is adapted)."""
    def column_parallel(module: str, rows: RowRange) -> Part | None:
        weights = adapter.weights.get((index, module))
        return None if weights is None else (weights.a, weights.b[rows.start : rows.stop])

    def row_parallel(module: str, columns: RowRange) -> Part | None:
        weights: LoRAWeights | None = adapter.weights.get((index, module))
        return None if weights is None else (weights.a[:, columns.start : columns.stop], weights.b)

    q_rows, kv_rows, mlp_rows = layout.q_rows(), layout.kv_rows(), layout.mlp_rows()
    return {
        "qkv_proj": [column_parallel("q_proj", q_rows), column_parallel("k_proj", kv_rows),
                     column_parallel("v_proj", kv_rows)],
        "o_proj": [row_parallel("o_proj", layout.o_columns())],
        "gate_up_proj": [column_parallel("gate_proj", mlp_rows), column_parallel("up_proj", mlp_rows)],
        "down_proj": [row_parallel("down_proj", layout.down_columns())],
    }
