"""How a mixture-of-experts checkpoint routes and where its experts live, read from its config.

Mixtral, Qwen2-MoE and Qwen3-MoE share one router: softmax over all experts in
float32, the top-k of those probabilities, optionally renormalised to sum to 1
(Mixtral always, the Qwen models when ``norm_topk_prob``). Renormalising the
top-k of a softmax is the same as a softmax over the top-k logits, so "softmax
after top-k" routers (vLLM's Mixtral) are this one. ``router_jitter_noise`` only
perturbs training. Qwen models may interleave dense layers
(``decoder_sparse_step``, ``mlp_only_layers``); Qwen2-MoE adds a shared expert
behind a sigmoid gate. Config keys of other MoE variants (grouped or biased
routing, sigmoid scoring, routed scaling) fail the load, naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the OpenAI door reads MOE_MODEL_TYPES, and transformers' config classes load torch
    from transformers import PretrainedConfig

# model_type -> (the block's checkpoint name, per-expert (gate, up, down) tensor names)
_CHECKPOINT_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
MOE_MODEL_TYPES = tuple(_CHECKPOINT_NAMES)

# Keys of other MoE routers, with the value under which they change nothing.
_NEUTRAL_VALUES: dict[str, object] = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "n_shared_experts": 0,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
}


@dataclass(frozen=True, slots=True)
class MoeTraits:
    """The routing and layout of one MoE architecture's sparse layers."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_topk: bool  # renormalise the top-k probabilities to sum to 1
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]  # per decoder layer: MoE block (True) or the dense MLP
    block_name: str  # the block's name in the checkpoint: model.layers.N.<block_name>.*
    expert_tensor_names: tuple[str, str, str]  # each expert's (gate, up, down) tensors: experts.E.<name>.weight


def moe_traits(config: PretrainedConfig, model_type: str) -> MoeTraits:
    """Read the MoE keys of a ``mixtral``, ``qwen2_moe`` or ``qwen3_moe`` config.

    ``ValueError`` naming the key for an MoE variant or value the native model does not run.
    """
    if model_type not in _CHECKPOINT_NAMES:
        raise ValueError(f"model_type={model_type!r} is not a supported mixture of experts: {MOE_MODEL_TYPES}")
    for key, neutral in _NEUTRAL_VALUES.items():
        value = getattr(config, key, neutral)
        if value is not None and value != neutral:
            raise ValueError(f"{model_type} config key {key}={value!r} is an unsupported MoE variant "
                             f"(supported: {key}={neutral!r} or absent)")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for {model_type}: the experts run "
                         "fused SiLU-and-multiply")
    num_layers = config.num_hidden_layers
    if model_type == "mixtral":
        num_experts = _positive(config, "num_local_experts")
        expert_size = _positive(config, "intermediate_size")
        sparse = (True,) * num_layers
        normalize, shared = True, 0
    else:
        num_experts = int(config.num_experts)
        expert_size = _positive(config, "moe_intermediate_size")
        sparse = _sparse_layers(config, num_experts)
        normalize = bool(config.norm_topk_prob)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
    top_k = _positive(config, "num_experts_per_tok")
    if any(sparse) and top_k > num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} exceeds the {num_experts} experts")
    block_name, tensor_names = _CHECKPOINT_NAMES[model_type]
    return MoeTraits(num_experts=num_experts, top_k=top_k, expert_intermediate_size=expert_size,
                     normalize_topk=normalize, shared_expert_intermediate_size=shared, sparse_layers=sparse,
                     block_name=block_name, expert_tensor_names=tensor_names)


def _sparse_layers(config: PretrainedConfig, num_experts: int) -> tuple[bool, ...]:
    """transformers' rule: sparse unless listed in ``mlp_only_layers``, on every ``decoder_sparse_step``-th layer."""
    num_layers = config.num_hidden_layers
    step = int(getattr(config, "decoder_sparse_step", 1) or 0)
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be a positive integer")
    dense_only = list(getattr(config, "mlp_only_layers", None) or [])
    outside = [layer for layer in dense_only if not 0 <= int(layer) < num_layers]
    if outside:
        raise ValueError(f"mlp_only_layers={dense_only} names layers outside the model's {num_layers}")
    if num_experts < 0:
        raise ValueError(f"num_experts={num_experts} must not be negative")
    return tuple(layer not in dense_only and num_experts > 0 and (layer + 1) % step == 0
                 for layer in range(num_layers))


def _positive(config: PretrainedConfig, key: str) -> int:
    value = getattr(config, key, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config key {key}={value!r} must be a positive integer")
    return value
