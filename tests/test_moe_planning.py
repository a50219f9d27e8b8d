"""``pagedllm plan`` for mixtures of experts: parameter counts, the bytes a decode step reads, the CLI's table."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pagedllm.cli import main
from pagedllm.planning.kv_math import weights_bytes_per_gpu
from pagedllm.planning.model_catalog import CATALOG, expected_experts_touched, spec_from_config
from pagedllm.planning.step_time import ModelCost

# The public totals: model cards and papers (Mixtral 46.7B total / 12.9B active; Qwen3 30.5B / 3.3B, 235B / 22B).
PUBLIC_PARAMS = {
    "Mixtral-8x7B": (46.7e9, 12.9e9),
    "Qwen3-30B-A3B": (30.5e9, 3.3e9),
    "Qwen3-235B-A22B": (235e9, 22e9),
}


@pytest.mark.parametrize("name", PUBLIC_PARAMS)
def test_catalog_parameter_counts_match_the_public_totals(name: str) -> None:
    spec = CATALOG[name]
    total, active = PUBLIC_PARAMS[name]
    assert spec.is_moe
    assert spec.num_params == pytest.approx(total, rel=0.01)
    assert spec.active_params == pytest.approx(active, rel=0.03)


def tiny_configs() -> dict[str, PretrainedConfig]:
    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=300, max_position_embeddings=256)
    return {
        "mixtral": MixtralConfig(**common, num_local_experts=6, num_experts_per_tok=2),
        "qwen3_moe": Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                                    mlp_only_layers=[2], head_dim=24),
        "qwen2_moe": Qwen2MoeConfig(**common, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=40,
                                    shared_expert_intermediate_size=72, decoder_sparse_step=2),
    }


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_config_spec_counts_exactly_what_transformers_builds(arch: str) -> None:
    """Dense/sparse layer mix, shared expert and its gate, routers, q/k norms: every parameter counted once."""
    config = tiny_configs()[arch]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = spec_from_config(arch, config.to_dict())
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.num_dense_layers == {"mixtral": 0, "qwen3_moe": 1, "qwen2_moe": 2}[arch]


def test_expected_experts_touched() -> None:
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert expected_experts_touched(8, 2, 64) == pytest.approx(8, rel=1e-6)
    assert expected_experts_touched(0, 0, 64) == 0.0
    counts = [expected_experts_touched(64, 4, b) for b in range(1, 40)]
    assert counts == sorted(counts) and counts[-1] < 64


def test_decode_step_reads_the_active_experts_only() -> None:
    spec = CATALOG["Qwen3-30B-A3B"]
    cost = ModelCost.of(spec, "bfloat16", "bfloat16")
    assert cost.weights_bytes == weights_bytes_per_gpu(spec, "bfloat16", 1) == spec.num_params * 2
    assert cost.weight_bytes_read(1) == pytest.approx(spec.active_params * 2)
    assert cost.weight_bytes_read(1) < cost.weight_bytes_read(16) < cost.weight_bytes_read(512) <= cost.weights_bytes
    assert cost.weight_bytes_read(4096) == pytest.approx(cost.weights_bytes)
    # A token multiplies through its active layer parameters only (the LM head is counted per sampled row).
    assert cost.flops_per_token == 2 * (spec.active_params - spec.embedding_params - spec.norm_params)
    dense = ModelCost.of(CATALOG["Qwen3-8B"], "bfloat16", "bfloat16")
    assert dense.weight_bytes_read(1) == dense.weights_bytes


def test_tensor_parallel_ranks_hold_a_slice_of_every_expert() -> None:
    spec = CATALOG["Mixtral-8x7B"]
    one, eight = (weights_bytes_per_gpu(spec, "bfloat16", tp) for tp in (1, 8))
    assert eight < one / 6  # the experts split 8 ways; only the KV projections are replicated past 8 KV heads
    assert ModelCost.of(spec, "bfloat16", "bfloat16", 8).expert_bytes * 8 == ModelCost.of(
        spec, "bfloat16", "bfloat16").expert_bytes


def test_plan_without_traffic_prints_weights_active_bytes_and_kv_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Qwen3-30B-A3B", "--gpu", "H100-SXM"]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split("  ", 1) for line in out.split("\n\n")[0].splitlines())
    assert "max_model_len → max concurrency" in out
    assert rows["model"].strip().startswith("Qwen3-30B-A3B (30.53B parameters")
    assert rows["weights per GPU"].strip() == "56.87 GiB"
    assert rows["active parameters"].strip().startswith("3.35B per token (8 of 128 experts")
    assert rows["active bytes per decode step"].strip().startswith("6.25 GiB at 1 seqs (8.0 experts)")
    assert "tokens" in rows["KV blocks"] and "max_model_len 40,960" in rows["max concurrency"]
