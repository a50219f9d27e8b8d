"""Quantized compressed-tensors checkpoints, made here from a tiny model: the engine decodes transformers'
greedy tokens from the same checkpoint, reads its KV-cache scales, and refuses broken ones by name.

The engine dequantizes the weights once and runs activations in the compute dtype (as vLLM does without
FP8 hardware); transformers, through compressed-tensors, also rounds each FP8 layer's input to FP8
(quantize-dequantize). The exactness comparison turns that rounding off in transformers
(``quantization_enabled = False``), so both compute the same thing; how far the two are apart with
the rounding on is in RESULTS ("Quantized checkpoints", scripts/quantized_accuracy.py)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.testing.quantized_checkpoint import make_quantized_checkpoint

from installed import need
need("compressed_tensors")

PROMPTS = [[5, 17, 301, 42, 9, 77, 1200], list(range(30, 90, 3)), [999, 3, 4, 5]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def quantized(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def build(scheme: str) -> Path:
        if scheme not in built:
            built[scheme] = make_quantized_checkpoint(tiny_model_dir("llama"), tmp_path_factory.mktemp(scheme),
                                                      scheme, kv_cache_scales=scheme == "fp8-tensor-static")
        return built[scheme]

    return build


def _transformers_greedy(model_dir: Path) -> list[list[int]]:
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.apply(disable_quantization)  # no activation rounding: dequantized weights, float32 activations
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("scheme", ["fp8-channel-dynamic", "fp8-tensor-static", "int8-channel"])
def test_quantized_checkpoint_decodes_transformers_greedy_tokens(quantized, scheme: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    model_dir = quantized(scheme)
    with caplog.at_level("INFO", logger="pagedllm.layers.quantization"):
        llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, attention_backend="torch")
    assert [r.message for r in caplog.records if "dequantized once at load" in r.message]
    ours = [list(out.outputs[0].token_ids) for out in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))]
    assert ours == _transformers_greedy(model_dir)


def test_checkpoint_kv_scales_feed_the_fp8_cache(quantized) -> None:
    model_dir = quantized("fp8-tensor-static")
    stored = load_file(str(model_dir / "model.safetensors"))
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype="fp8_e4m3", num_kv_blocks=64, attention_backend="torch")
    for index, layer in enumerate(llm.engine.model.model.layers):
        scales = layer.self_attn.kv_scales
        assert float(scales.k) == pytest.approx(float(stored[f"model.layers.{index}.self_attn.k_scale"]))
        assert float(scales.v) == pytest.approx(float(stored[f"model.layers.{index}.self_attn.v_scale"]))
        assert not scales.pending
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 4


def _broken_copy(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_a_corrupt_scale_fails_the_load_naming_the_tensor(quantized, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight_scale"

    def corrupt(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name][3, 0] = float("nan")

    broken = _broken_copy(quantized("fp8-channel-dynamic"), tmp_path / "corrupt", corrupt)
    with pytest.raises(ValueError, match=name):
        LLM(str(broken), dtype="float32", num_kv_blocks=16)


def test_a_missing_scale_fails_the_load_naming_the_tensor(quantized, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    broken = _broken_copy(quantized("fp8-channel-dynamic"), tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name):
        LLM(str(broken), dtype="float32", num_kv_blocks=16)


def test_an_unknown_scheme_fails_the_load_naming_the_key(quantized, tmp_path: Path) -> None:
    broken = tmp_path / "unknown"
    shutil.copytree(quantized("fp8-channel-dynamic"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.format='nvfp4-pack-quantized'"):
        LLM(str(broken), dtype="float32", num_kv_blocks=16)
