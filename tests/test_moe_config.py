"""Reading a mixture of experts from its config: the router, the dense/sparse layer mix, and named refusals."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, MixtralConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pagedllm.cli import main
from pagedllm.models import load_model, resolve_architecture
from pagedllm.layers.moe_traits import moe_traits
from pagedllm.attention.backends import attention_backend_named

COMMON: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=48, vocab_size=64)


def qwen3_moe(**overrides: Any) -> PretrainedConfig:
    return Qwen3MoeConfig(**{**COMMON, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                             **overrides})


def test_mixtral_routes_top_k_renormalised_on_every_layer() -> None:
    config = MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.1)
    traits = resolve_architecture(config)
    assert traits.name == "MixtralForCausalLM" and not traits.qkv_bias and not traits.qk_norm
    moe = traits.moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.normalize_topk) == (8, 2, 48, True)
    assert moe.sparse_layers == (True,) * 6 and moe.shared_expert_intermediate_size == 0
    assert (moe.block_name, moe.expert_tensor_names) == ("block_sparse_moe", ("w1", "w3", "w2"))


def test_qwen_layer_mix_follows_decoder_sparse_step_and_mlp_only_layers() -> None:
    moe = resolve_architecture(qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)).moe
    assert moe is not None and moe.normalize_topk
    assert moe.sparse_layers == (False, True, False, False, False, True)
    config = Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=40)
    traits = resolve_architecture(config)
    assert traits.qkv_bias and traits.moe is not None
    assert traits.moe.shared_expert_intermediate_size == 40 and not traits.moe.normalize_topk
    assert traits.moe.sparse_layers == (True,) * 6
    no_experts = resolve_architecture(Qwen2MoeConfig(**COMMON, num_experts=0)).moe
    assert no_experts is not None and not any(no_experts.sparse_layers)


@pytest.mark.parametrize("overrides,key", [
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"n_group": 8, "topk_group": 4}, "n_group"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [6]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
])
def test_unsupported_variants_fail_naming_the_key(overrides: dict[str, Any], key: str) -> None:
    config = qwen3_moe()
    for name, value in overrides.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=key):
        moe_traits(config, "qwen3_moe")


def test_loading_an_unsupported_variant_names_the_key(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = tmp_path / "variant"
    shutil.copytree(tiny_model_dir("qwen3_moe"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "scoring_func": "sigmoid"}))
    with pytest.raises(ValueError, match="scoring_func='sigmoid'"):
        load_model(model_dir, torch.float32, torch.device("cpu"), attention_backend_named("torch"))


def test_make_tiny_model_cli_writes_a_moe_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-tiny-model", str(tmp_path / "mixtral"), "--arch", "mixtral"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote mixtral (tiny) checkpoint to {tmp_path / 'mixtral'}"
    moe = resolve_architecture(AutoConfig.from_pretrained(tmp_path / "mixtral")).moe
    assert moe is not None and (moe.num_experts, moe.top_k) == (8, 2)
