"""Which checkpoints the native Llama-family model can run, and how each differs."""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from pagedllm.layers.moe_traits import MOE_MODEL_TYPES, MoeTraits, moe_traits


@dataclass(frozen=True, slots=True)
class ArchitectureTraits:
    """The per-architecture switches of the shared Llama-family forward."""

    name: str  # the transformers class, e.g. "Qwen2ForCausalLM"
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before rope
    sliding_window: int | None  # attention span limit, None when every layer attends fully
    moe: MoeTraits | None = None  # mixtures of experts: the router and which layers are sparse


# model_type -> transformers class name; the classes whose weights and forward we mirror.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def resolve_architecture(config: PretrainedConfig) -> ArchitectureTraits:
    """Read the architecture from ``config.architectures`` (else ``model_type``).

    Raises ``ValueError`` naming the architecture and the supported list when
    it is not one of the Llama family members we implement.
    """
    declared = list(getattr(config, "architectures", None) or [])
    by_class = {cls: model_type for model_type, cls in SUPPORTED_ARCHITECTURES.items()}
    model_type = next((by_class[name] for name in declared if name in by_class), None)
    if model_type is None and not declared:
        model_type = config.model_type if config.model_type in SUPPORTED_ARCHITECTURES else None
    if model_type is None:
        found = declared or [config.model_type]
        raise ValueError(
            f"unsupported architecture {found}; supported: {sorted(SUPPORTED_ARCHITECTURES.values())}"
        )
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ArchitectureTraits(
        name=SUPPORTED_ARCHITECTURES[model_type],
        qkv_bias=(model_type == "qwen2" or (model_type in ("llama", "qwen3", "qwen3_moe") and attention_bias)
                  or (model_type == "qwen2_moe" and bool(getattr(config, "qkv_bias", True)))),
        o_bias=model_type in ("llama", "qwen3", "qwen3_moe") and attention_bias,
        mlp_bias=model_type == "llama" and bool(getattr(config, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=_sliding_window(config, model_type),
        moe=moe_traits(config, model_type) if model_type in MOE_MODEL_TYPES else None,
    )


def _sliding_window(config: PretrainedConfig, model_type: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None or model_type == "llama":
        return None
    if model_type in ("mistral", "mixtral", "qwen3_moe"):  # every layer; Qwen3-MoE's config sets it only when used
        return int(window)
    # Qwen2/Qwen3/Qwen2-MoE apply the window only to the layers marked "sliding_attention".
    layer_types = getattr(config, "layer_types", None) or []
    return int(window) if "sliding_attention" in layer_types else None
