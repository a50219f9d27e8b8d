"""Read and check a PEFT LoRA folder: ``adapter_config.json`` and ``adapter_model.safetensors``.

The engine reads PEFT's format itself (json + safetensors), so ``peft`` is not a run-time dependency. What it does
not run is refused with a ``ValueError`` naming the config key, tensor or module: DoRA, ``modules_to_save``,
adapted embeddings or LM heads, per-module rank/alpha patterns, LoRA biases, experts of MoE blocks, targets
outside q/k/v/o/gate/up/down, a rank above ``max_lora_rank`` and shapes that differ from the base model's.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig

from pagedllm.layers.moe_traits import MOE_MODEL_TYPES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_EMBEDDING_OR_HEAD = ("embed_tokens", "lm_head")


@dataclass(frozen=True, slots=True)
class BaseModelShape:
    """What an adapter must fit: each target's (in, out) features, unsharded, and the number of layers."""

    num_layers: int
    features: dict[str, tuple[int, int]]  # module name -> (in_features, out_features)
    moe: bool  # the MLP blocks are mixtures of experts: adapters may not target gate/up/down


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapted linear: ``A`` [rank, in] and ``B`` [out, rank], as PEFT stores them."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A checked adapter in host memory: ``weights[(layer, module)]``, applied as ``y += scale * x A^T B^T``."""

    name: str
    path: str
    rank: int
    scale: float
    base_model_name_or_path: str | None
    weights: dict[tuple[int, str], LoRAWeights]

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)


def config_model_shape(config: PretrainedConfig) -> BaseModelShape:
    """The whole (unsharded) linear shapes of a Llama-family config, as adapters must match them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, mlp = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    features = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden)}
    return BaseModelShape(config.num_hidden_layers, features, config.model_type in MOE_MODEL_TYPES)


def load_adapter(name: str, path: str | Path, shape: BaseModelShape, max_lora_rank: int) -> LoRAAdapter:
    """The adapter in ``path``, checked against ``shape`` and ``max_lora_rank``; ``ValueError`` naming the problem."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: lora_path {str(folder)!r} does not exist or is not a directory")
    config = _read_config(name, folder)
    rank, scale = _check_config(name, config, max_lora_rank)
    weights = _read_weights(name, folder / WEIGHTS_FILE)
    pairs = _pair_weights(name, weights, shape, rank)
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights of q/k/v/o/gate/up/down")
    base = config.get("base_model_name_or_path")
    return LoRAAdapter(name, str(folder), rank, scale, base if isinstance(base, str) else None, pairs)


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is missing from {str(folder)!r}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(name: str, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    """(rank, scale) of a config the engine can run; ``ValueError`` naming the first key it cannot."""
    def refuse(key: str, why: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} {key}={config.get(key)!r} is not supported: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", "only LORA adapters are served")
    if config.get("use_dora"):
        raise refuse("use_dora", "DoRA adapters are not served")
    if config.get("modules_to_save"):
        raise refuse("modules_to_save", "the adapter replaces whole modules (a modified embedding or LM head)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise refuse(key, "per-module ranks and alphas are not served")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise refuse("bias" if config.get("bias", "none") != "none" else "lora_bias", "LoRA biases are not served")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for module in targets:
            if module in _EMBEDDING_OR_HEAD:
                raise refuse("target_modules", f"{module!r} is an embedding or LM head; the adapter would modify it")
            if module not in TARGET_MODULES:
                raise refuse("target_modules", f"{module!r} is not one of {', '.join(TARGET_MODULES)}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse("r", "expected a positive integer")
    if rank > max_lora_rank:
        raise refuse("r", f"the rank is above max_lora_rank={max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise refuse("lora_alpha", "expected a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _read_weights(name: str, file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is missing from {str(file.parent)!r}")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is corrupt or unreadable ({error})") from error


def _pair_weights(name: str, weights: dict[str, torch.Tensor], shape: BaseModelShape,
                  rank: int) -> dict[tuple[int, str], LoRAWeights]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} adapts a module the engine does not serve "
                             f"({_what_it_adapts(key)})")
        layer, block, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in TARGET_MODULES or (block == "self_attn") != (module in ATTENTION_MODULES):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} targets module {module!r}, which is not one of "
                             f"{', '.join(TARGET_MODULES)}")
        if shape.moe and module in MLP_MODULES:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} targets {module!r} of a mixture-of-experts block; "
                             "LoRA on experts is not served")
        if layer >= shape.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, but the base model has "
                             f"{shape.num_layers} layers (base model mismatch)")
        halves.setdefault((layer, module), {})[half] = tensor
    pairs: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), half in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(half) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_{''.join(half)} but not its other half")
        a, b = half["A"], half["B"]
        in_features, out_features = shape.features[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"which do not match r={rank}")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise ValueError(f"LoRA adapter {name!r}: {where} adapts a {a.shape[1]}->{b.shape[0]} linear, but the "
                             f"base model's is {in_features}->{out_features} (base model mismatch)")
        pairs[(layer, module)] = LoRAWeights(a.float(), b.float())
    return pairs


def _what_it_adapts(key: str) -> str:
    if "lora_embedding" in key or any(part in key for part in _EMBEDDING_OR_HEAD):
        return "a modified embedding or LM head"
    if "experts" in key:
        return "experts of a mixture-of-experts block"
    if "magnitude_vector" in key:
        return "a DoRA magnitude"
    return "only lora_A/lora_B of q/k/v/o/gate/up/down in model.layers are served"
