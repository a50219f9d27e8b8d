"""A PEFT LoRA folder, read and checked without loading its tensors: ``adapter_config.json`` and the shapes in
``adapter_model.safetensors``' header.

The engine reads PEFT's format itself (json + safetensors), so ``peft`` is not a run-time dependency. What it does
not run is refused with a ``ValueError`` naming the config key, tensor or module: DoRA, ``modules_to_save``,
adapted embeddings or LM heads, per-module rank/alpha patterns, LoRA biases, experts of MoE blocks, targets
outside q/k/v/o/gate/up/down, a rank above ``max_lora_rank`` and shapes that differ from the base model's.
This module imports no torch: the launcher and the OpenAI door check adapters with it.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

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
class AdapterFiles:
    """A checked adapter folder: ``tensors[(layer, module)]`` names its lora_A and lora_B tensors."""

    name: str
    path: str
    rank: int
    scale: float
    base_model_name_or_path: str | None
    weights_file: Path
    tensors: dict[tuple[int, str], tuple[str, str]]


def base_model_shape(config: Mapping[str, Any]) -> BaseModelShape:
    """The whole (unsharded) linear shapes of a Llama-family ``config.json``, as adapters must match them."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    hidden, mlp = config["hidden_size"], config["intermediate_size"]
    q, kv = heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim
    features = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden)}
    return BaseModelShape(config["num_hidden_layers"], features, config.get("model_type") in MOE_MODEL_TYPES)


def checkpoint_shape(model_dir: Path) -> BaseModelShape:
    """``base_model_shape`` of the checkpoint in ``model_dir``."""
    return base_model_shape(json.loads((Path(model_dir) / "config.json").read_text()))


def check_adapter(name: str, path: str | Path, shape: BaseModelShape, max_lora_rank: int) -> AdapterFiles:
    """The adapter in ``path``, checked against ``shape`` and ``max_lora_rank``; ``ValueError`` naming the problem."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: lora_path {str(folder)!r} does not exist or is not a directory")
    config = _read_config(name, folder)
    rank, scale = _check_config(name, config, max_lora_rank)
    weights_file = folder / WEIGHTS_FILE
    tensors = _pair_tensors(name, _read_shapes(name, weights_file), shape, rank)
    if not tensors:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights of q/k/v/o/gate/up/down")
    base = config.get("base_model_name_or_path")
    return AdapterFiles(name=name, path=str(folder), rank=rank, scale=scale,
                        base_model_name_or_path=base if isinstance(base, str) else None, weights_file=weights_file,
                        tensors=tensors)


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


def _read_shapes(name: str, file: Path) -> dict[str, tuple[int, ...]]:
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is missing from {str(file.parent)!r}")
    try:
        with safe_open(str(file), framework="numpy") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is corrupt or unreadable ({error})") from error


def _pair_tensors(name: str, shapes: dict[str, tuple[int, ...]], shape: BaseModelShape,
                  rank: int) -> dict[tuple[int, str], tuple[str, str]]:
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
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
        halves.setdefault((layer, module), {})[half] = key
    pairs: dict[tuple[int, str], tuple[str, str]] = {}
    for (layer, module), half in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(half) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_{''.join(half)} but not its other half")
        a, b = shapes[half["A"]], shapes[half["B"]]
        in_features, out_features = shape.features[module]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_A {a} and lora_B {b}, "
                             f"which do not match r={rank}")
        if a[1] != in_features or b[0] != out_features:
            raise ValueError(f"LoRA adapter {name!r}: {where} adapts a {a[1]}->{b[0]} linear, but the "
                             f"base model's is {in_features}->{out_features} (base model mismatch)")
        pairs[(layer, module)] = (half["A"], half["B"])
    return pairs


def _what_it_adapts(key: str) -> str:
    if "lora_embedding" in key or any(part in key for part in _EMBEDDING_OR_HEAD):
        return "a modified embedding or LM head"
    if "experts" in key:
        return "experts of a mixture-of-experts block"
    if "magnitude_vector" in key:
        return "a DoRA magnitude"
    return "only lora_A/lora_B of q/k/v/o/gate/up/down in model.layers are served"
