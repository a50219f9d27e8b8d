"""Random LoRA adapters in PEFT's folder format, written without ``peft`` (benchmarks and format tests).

The exactness tests build theirs with ``peft`` itself; this writer produces the same two files
(``adapter_config.json``, ``adapter_model.safetensors`` with PEFT's key names) for a base checkpoint's shapes.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from pagedllm.lora.adapter_files import base_model_shape

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_random_adapter(base_dir: Path, out_dir: Path, rank: int, alpha: float, seed: int,
                        target_modules: Sequence[str] = ALL_LINEAR, use_rslora: bool = False,
                        std: float = 0.05) -> Path:
    """Write an adapter of ``base_dir``'s model with random ``A`` and ``B`` into ``out_dir`` and return it."""
    config = AutoConfig.from_pretrained(base_dir)
    features = base_model_shape(config.to_dict()).features
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module in target_modules:
            block = "self_attn" if module in ALL_LINEAR[:4] else "mlp"
            in_features, out_features = features[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
                      "target_modules": list(target_modules), "base_model_name_or_path": str(base_dir),
                      "use_dora": False, "modules_to_save": None, "bias": "none", "task_type": "CAUSAL_LM"}
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out_dir
