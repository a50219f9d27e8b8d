"""compressed-tensors quantization configs and scale tensors: what loads, and the named errors for what does not."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from pagedllm.layers.quantization import (CheckpointQuantization, QuantizedWeights, WeightScheme,
                                          checkpoint_quantization, dequantize_weight, kv_cache_scales)
from pagedllm.distributed.sharding import RowRange

FP8_CHANNEL_DYNAMIC: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True},
    }},
    "ignore": ["lm_head"],
    "quantization_status": "compressed",
}


class Config:
    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        self.quantization_config = quantization_config


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    config = copy.deepcopy(FP8_CHANNEL_DYNAMIC)
    target = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return config


def test_an_fp8_channel_config_parses_to_its_scheme() -> None:
    parsed = checkpoint_quantization(Config(FP8_CHANNEL_DYNAMIC))
    assert parsed == CheckpointQuantization(WeightScheme(torch.float8_e4m3fn, True, "dynamic"), ("lm_head",), False)
    assert parsed.quantizes("model.layers.0.self_attn.q_proj.weight")
    assert not parsed.quantizes("lm_head.weight") and not parsed.quantizes("model.embed_tokens.weight")
    assert parsed.is_auxiliary("model.layers.0.mlp.up_proj.weight_scale")
    assert checkpoint_quantization(Config(None)) is None


@pytest.mark.parametrize("path, value, message", [
    (("quant_method",), "gptq", "quant_method='gptq' is not supported"),
    (("format",), "marlin-24", "format='marlin-24' is not supported"),
    (("config_groups", "group_0", "weights", "num_bits"), 4, "4-bit float weights are not supported"),
    (("config_groups", "group_0", "weights"), {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128,
                                              "symmetric": True, "dynamic": False},
     "weights.strategy='group' is not supported"),
    (("config_groups", "group_0", "weights", "strategy"), "group", "group_0.weights is invalid: .*group_size"),
    (("config_groups", "group_0", "targets"), ["Attention"], "targets=\\['Attention'\\] is not supported"),
    (("config_groups", "group_0", "weights", "type"), "nonsense", "quantization_config.config_groups"),
])
def test_unsupported_configs_fail_naming_the_key(path: tuple[str, ...], value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization(Config(_with(path, value)))


SCHEME = WeightScheme(torch.float8_e4m3fn, True, "none")


def test_dequantize_multiplies_each_row_by_its_scale() -> None:
    weight = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5], [2.0]])
    out = dequantize_weight("layers.0.q_proj.weight", weight, scale, SCHEME, torch.float32)
    assert torch.equal(out, torch.tensor([[0.5, -1.0], [1.0, 8.0]]))


@pytest.mark.parametrize("scale, message", [
    (None, "layers.0.q_proj.weight_scale is missing"),
    (torch.tensor([[0.5], [float("nan")]]), "layers.0.q_proj.weight_scale holds a scale that is not finite"),
    (torch.tensor([[0.5], [-1.0]]), "layers.0.q_proj.weight_scale holds a scale that is not finite and > 0"),
    (torch.tensor([[0.5], [1.0], [1.0]]), "layers.0.q_proj.weight_scale has shape \\(3, 1\\)"),
    (torch.tensor([[1], [2]], dtype=torch.int32), "layers.0.q_proj.weight_scale is torch.int32"),
])
def test_bad_scales_fail_naming_the_tensor(scale: torch.Tensor | None, message: str) -> None:
    weight = torch.ones(2, 2).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=message):
        dequantize_weight("layers.0.q_proj.weight", weight, scale, SCHEME, torch.float32)


def test_a_weight_of_another_dtype_than_the_config_says_fails() -> None:
    with pytest.raises(ValueError, match="layers.0.q_proj.weight is torch.int8"):
        dequantize_weight("layers.0.q_proj.weight", torch.ones(2, 2, dtype=torch.int8), torch.ones(2, 1), SCHEME,
                          torch.float32)


def test_quantized_weights_cut_a_rank_s_rows_after_dequantizing() -> None:
    weights = QuantizedWeights(checkpoint_quantization(Config(FP8_CHANNEL_DYNAMIC)), torch.float32)
    stored = {"m.q_proj.weight": torch.arange(6.0).reshape(3, 2).to(torch.float8_e4m3fn),
              "m.q_proj.weight_scale": torch.tensor([[1.0], [2.0], [3.0]])}
    part = weights.load("m.q_proj.weight", RowRange(0, 1, 3, 4), stored.get)
    assert torch.equal(part, torch.tensor([[4.0, 6.0], [12.0, 15.0], [0.0, 0.0], [0.0, 0.0]]))


def test_static_activations_need_a_sound_input_scale() -> None:
    config = _with(("config_groups", "group_0", "input_activations"),
                   {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False})
    weights = QuantizedWeights(checkpoint_quantization(Config(config)), torch.float32)
    stored = {"m.q_proj.weight": torch.ones(1, 2).to(torch.float8_e4m3fn), "m.q_proj.weight_scale": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="m.q_proj.input_scale is missing"):
        weights.load("m.q_proj.weight", None, stored.get)
    stored["m.q_proj.input_scale"] = torch.tensor([0.0])
    with pytest.raises(ValueError, match="m.q_proj.input_scale holds a scale"):
        weights.load("m.q_proj.weight", None, stored.get)


def test_kv_cache_scales_are_read_per_layer_and_checked() -> None:
    config = dict(FP8_CHANNEL_DYNAMIC, kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "symmetric": True, "dynamic": False})
    parsed = checkpoint_quantization(Config(config))
    assert parsed.kv_cache and parsed.is_auxiliary("model.layers.1.self_attn.v_scale")
    stored = {f"model.layers.{i}.self_attn.{side}_scale": torch.tensor(0.1 * (i + 1) + (side == "v"))
              for i in range(2) for side in "kv"}
    scales = kv_cache_scales(parsed, 2, stored.get)
    assert sorted(scales) == [0, 1]
    assert list(scales[0]) == pytest.approx([0.1, 1.1]) and list(scales[1]) == pytest.approx([0.2, 1.2])
    del stored["model.layers.1.self_attn.v_scale"]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.v_scale is missing"):
        kv_cache_scales(parsed, 2, stored.get)
    stored["model.layers.1.self_attn.v_scale"] = torch.tensor(float("inf"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.v_scale holds a scale"):
        kv_cache_scales(parsed, 2, stored.get)
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        checkpoint_quantization(Config(dict(config, kv_cache_scheme=dict(config["kv_cache_scheme"], num_bits=4))))
