"""Tiny random checkpoints: deterministic, complete, and loadable by transformers itself."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.testing.tiny_model import main, make_tiny_model


def tensors_of(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_same_seed_gives_identical_files(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    first = tiny_model_dir("qwen3")
    second = make_tiny_model(tmp_path / "again", arch="qwen3", seed=0)
    names = sorted(path.name for path in first.iterdir())
    assert names == sorted(path.name for path in second.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_other_seed_gives_other_weights_same_shapes(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    base = tensors_of(tiny_model_dir("llama"))
    other = tensors_of(make_tiny_model(tmp_path / "seed1", arch="llama", seed=1))
    assert {k: v.shape for k, v in base.items()} == {k: v.shape for k, v in other.items()}
    assert not any(torch.equal(base[name], other[name]) for name in base)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_loads_with_transformers(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__.lower().startswith(arch)
    assert 2_500_000 < sum(p.numel() for p in model.parameters()) < 4_500_000
    assert len(tokenizer) == model.config.vocab_size == 2048
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 0
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 2048)
    assert torch.isfinite(logits).all()


def test_architecture_specific_features(tiny_model_dir: Callable[[str], Path]) -> None:
    configs = {arch: json.loads((tiny_model_dir(arch) / "config.json").read_text())
               for arch in ("llama", "mistral", "qwen2", "qwen3")}
    assert configs["llama"]["rope_parameters"]["rope_type"] == "llama3"
    assert configs["mistral"]["sliding_window"] > configs["mistral"]["max_position_embeddings"]
    assert configs["qwen2"]["tie_word_embeddings"] is True
    assert "model.layers.0.self_attn.q_proj.bias" in tensors_of(tiny_model_dir("qwen2"))
    assert configs["qwen3"]["head_dim"] * configs["qwen3"]["num_attention_heads"] != configs["qwen3"]["hidden_size"]
    # Norms and biases are perturbed so a loader that skipped them would change the output.
    qwen2 = tensors_of(tiny_model_dir("qwen2"))
    assert not torch.equal(qwen2["model.norm.weight"], torch.ones_like(qwen2["model.norm.weight"]))
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].abs().sum() > 0


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="size must be one of"):
        make_tiny_model(tmp_path, size="huge")


def test_command_line_entry_writes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli"), "--arch", "mistral", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"]
