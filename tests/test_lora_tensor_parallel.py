"""The LoRA terms of a tensor-parallel rank follow the base weights' layout (pagedllm.distributed.sharding).

Without processes: each rank's adapted linears are built at its share's sizes and fed its share of the input, as
the model does. Column-parallel q|k|v and gate|up: each rank's output rows equal the same rows of the TP=1 term
(B split by the base rows, KV heads replicated when ranks outnumber them). Row-parallel o_proj and down_proj: the
ranks' terms, added before the all-reduce, sum to the TP=1 term (A split by the base's input columns).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.lora.adapted_model import layer_parts
from pagedllm.lora.adapter import LoRAAdapter, LoRAWeights
from pagedllm.lora.linear import LoRAContext, LoRALinear
from pagedllm.lora.mapping import build_lora_mapping
from pagedllm.distributed.sharding import ModelShape, ShardLayout, shard_layout

SHAPE = ModelShape(num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=128)
HIDDEN, RANK, TOKENS = 32, 4, 5


def adapter() -> LoRAAdapter:
    g = torch.Generator().manual_seed(0)
    q, kv, mlp = 32, 16, 64
    shapes = {"q_proj": (HIDDEN, q), "k_proj": (HIDDEN, kv), "v_proj": (HIDDEN, kv), "o_proj": (q, HIDDEN),
              "gate_proj": (HIDDEN, mlp), "up_proj": (HIDDEN, mlp), "down_proj": (mlp, HIDDEN)}
    weights = {(0, name): LoRAWeights(torch.randn(RANK, i, generator=g), torch.randn(o, RANK, generator=g))
               for name, (i, o) in shapes.items()}
    return LoRAAdapter("a", "/unused", RANK, 0.5, None, weights)


def terms(layout: ShardLayout, x_in: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each adapted linear's LoRA term at ``layout``'s sizes (zero base weights), for its input."""
    q, kv, mlp = layout.num_heads * 8, layout.num_kv_heads * 8, layout.intermediate_size
    sizes = {"qkv_proj": (HIDDEN, (q, kv, kv)), "o_proj": (q, (HIDDEN,)), "gate_up_proj": (HIDDEN, (mlp, mlp)),
             "down_proj": (mlp, (HIDDEN,))}
    context = LoRAContext()
    context.mapping = build_lora_mapping(np.array([0]), np.array([TOKENS]), torch.device("cpu"))
    parts = layer_parts(adapter(), 0, layout)
    out = {}
    for name, (in_features, part_sizes) in sizes.items():
        base = nn.Linear(in_features, sum(part_sizes), bias=False)
        nn.init.zeros_(base.weight)
        linear = LoRALinear(base, part_sizes, 1, RANK, context, torch.float32, torch.device("cpu"))
        linear.set_slot(0, parts[name], 0.5)
        with torch.no_grad():
            out[name] = linear(x_in[name])
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_rank_terms_assemble_into_the_single_rank_term(size: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = {"qkv_proj": torch.randn(TOKENS, HIDDEN, generator=g), "o_proj": torch.randn(TOKENS, 32, generator=g),
         "gate_up_proj": torch.randn(TOKENS, HIDDEN, generator=g), "down_proj": torch.randn(TOKENS, 64, generator=g)}
    whole = terms(shard_layout(SHAPE, 0, 1), x)
    q_whole, k_whole, v_whole = whole["qkv_proj"].split([32, 16, 16], dim=-1)
    gate_whole, up_whole = whole["gate_up_proj"].split([64, 64], dim=-1)
    o_sum, down_sum = torch.zeros(TOKENS, HIDDEN), torch.zeros(TOKENS, HIDDEN)
    for rank in range(size):
        layout = shard_layout(SHAPE, rank, size)
        o_cols, d_cols = layout.o_columns(), layout.down_columns()
        local = terms(layout, {**x, "o_proj": x["o_proj"][:, o_cols.start : o_cols.stop],
                               "down_proj": x["down_proj"][:, d_cols.start : d_cols.stop]})
        q_rows, kv_rows, mlp_rows = layout.q_rows(), layout.kv_rows(), layout.mlp_rows()
        q, k, v = local["qkv_proj"].split([q_rows.size, kv_rows.size, kv_rows.size], dim=-1)
        torch.testing.assert_close(q, q_whole[:, q_rows.start : q_rows.stop])
        torch.testing.assert_close(k, k_whole[:, kv_rows.start : kv_rows.stop])
        torch.testing.assert_close(v, v_whole[:, kv_rows.start : kv_rows.stop])
        gate, up = local["gate_up_proj"].split([mlp_rows.size, mlp_rows.size], dim=-1)
        torch.testing.assert_close(gate, gate_whole[:, mlp_rows.start : mlp_rows.stop])
        torch.testing.assert_close(up, up_whole[:, mlp_rows.start : mlp_rows.stop])
        o_sum += local["o_proj"]
        down_sum += local["down_proj"]
    torch.testing.assert_close(o_sum, whole["o_proj"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(down_sum, whole["down_proj"], rtol=1e-5, atol=1e-5)


def test_tp2_engine_gives_the_single_rank_tokens_through_swapped_adapters(tiny_model_dir, tmp_path) -> None:
    """Three adapters and base-only requests over two slots at TP=2 (gloo): slot loads reach the worker rank."""
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.testing.lora_adapters import make_random_adapter

    model_dir = tiny_model_dir("llama")
    adapters = [LoRARequest(f"a{i}", i + 1, str(make_random_adapter(model_dir, tmp_path / f"a{i}", rank, 16, seed=i,
                                                                    std=0.2)))
                for i, rank in enumerate((8, 16, 4))]
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=g).tolist()} for n in (5, 40, 23, 70, 9, 31)]
    loras = [adapters[i % 3] if i % 4 != 3 else None for i in range(len(prompts))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    settings = {"dtype": "float32", "enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "num_kv_blocks": 64,
                "max_num_seqs": 3}
    with LLM(str(model_dir), **settings) as single:
        want = [out.outputs[0].token_ids for out in single.generate(prompts, params, lora_request=loras)]
    with LLM(str(model_dir), tensor_parallel_size=2, **settings) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, lora_request=loras)]
        assert llm.engine.lora is not None and llm.engine.lora.slots.num_evictions > 0
    # Two ranks sum the row-parallel products in another order: an exact top-two tie may flip, nothing more.
    assert sum(a != b for a, b in zip(got, want)) <= 1, (got, want)
