"""Deterministic random-weight Llama-family checkpoints for tests and benchmarks.

``make_tiny_model(dir, arch, seed, size)`` writes what a real Hugging Face
checkpoint directory holds: ``config.json``, ``generation_config.json``,
``model.safetensors`` and a tokenizer, all built locally with transformers and
``tokenizers`` (the tokenizer is trained on Python standard-library sources;
nothing is downloaded). The same arguments always give byte-identical files.

Each architecture exercises a different code path of the native model:

* llama:   untied head, llama3 rope scaling (``rope_parameters``), GQA;
* mistral: untied head, a ``sliding_window`` larger than the context;
* qwen2:   q/k/v bias, tied embeddings;
* qwen3:   per-head q/k RMSNorm, explicit ``head_dim`` != hidden / heads;
* mixtral: 8 experts, top-2 (renormalised), every layer sparse;
* qwen3_moe: 16 experts, top-4, ``norm_topk_prob``, layer 1 dense (``mlp_only_layers``), q/k norms;
* qwen2_moe: 12 experts, top-4, no renormalisation, a gated shared expert, every second layer sparse
  (``decoder_sparse_step``), q/k/v bias.

``overrides`` replaces config keys (tests vary the routing and the dense/sparse mix with it).

Weights use a large ``initializer_range`` so logits are peaked and greedy
decoding has no near-ties; norm weights and biases are perturbed away from
their 1/0 initial values so a loader that dropped them would be caught.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from pagedllm.testing.tokenizer_training import python_stdlib_texts, train_bpe_tokenizer

ARCHES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
}


@dataclass(frozen=True, slots=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tokenizer_corpus_bytes: int  # how much stdlib text the tokenizer is trained on


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(256, 4, 4, 2, 512, 2048, 1024, 1 << 20),  # ~3.4M parameters
    "small": ModelSize(512, 8, 8, 2, 1536, 8192, 2048, 4 << 20),  # ~32M parameters
}

INITIALIZER_RANGE = 0.15
EOS_TOKEN_ID = 0  # ``<|endoftext|>`` in every tokenizer from pagedllm.testing.tokenizer_training


def make_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0, size: str = "tiny",
                    overrides: Mapping[str, Any] | None = None, shape: ModelSize | None = None) -> Path:
    """Write a random-weight ``arch`` checkpoint of ``size`` (or of ``shape``, when given) into ``out_dir``."""
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {sorted(ARCHES)}, got {arch!r}")
    if shape is None and size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    shape = shape or SIZES[size]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(
        python_stdlib_texts(limit_bytes=shape.tokenizer_corpus_bytes), shape.vocab_size, out_dir
    )
    config_cls, model_cls = ARCHES[arch]
    config = config_cls(**{**_config_kwargs(arch, shape, vocab_size=len(tokenizer)), **(overrides or {})})
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_cls(config)
    _perturb_norms_and_biases(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _config_kwargs(arch: str, shape: ModelSize, vocab_size: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=INITIALIZER_RANGE,
        rms_norm_eps=1e-6,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=arch == "qwen2",
        dtype="float32",
    )
    if arch == "llama":
        kwargs["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": shape.max_position_embeddings // 4,
        }
    elif arch == "mistral":
        kwargs["sliding_window"] = 4 * shape.max_position_embeddings
    elif arch == "qwen2":
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    elif arch == "qwen3":
        kwargs["head_dim"] = 3 * shape.hidden_size // (2 * shape.num_heads)
    elif arch == "mixtral":
        # Mixtral's intermediate_size is each expert's.
        kwargs.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=shape.intermediate_size // 4)
    elif arch == "qwen3_moe":
        kwargs.update(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=shape.intermediate_size // 4,
                      norm_topk_prob=True, mlp_only_layers=[1], head_dim=3 * shape.hidden_size // (2 * shape.num_heads))
    elif arch == "qwen2_moe":
        kwargs.update(num_experts=12, num_experts_per_tok=4, moe_intermediate_size=shape.intermediate_size // 4,
                      shared_expert_intermediate_size=shape.intermediate_size // 2, norm_topk_prob=False,
                      decoder_sparse_step=2)
    return kwargs


def _perturb_norms_and_biases(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a deterministic random-weight Llama-family checkpoint.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=sorted(ARCHES), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args(argv)
    print(make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed, size=args.size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
