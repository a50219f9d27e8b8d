"""Model shapes for planning: hyperparameters only, from a checkpoint, the local HF cache or a built-in catalog.

Planning needs no weights: the KV cache, the weight bytes and the FLOPs of a
step all follow from the config. The catalog holds the public ``config.json``
values of well-known checkpoints (base models), so a plan for Llama-3.1-8B
works on a machine that never downloaded it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    model_type: str  # llama, mistral, qwen2, qwen3
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # the engine keeps contexts within it (sliding attention is not implemented)

    @property
    def context_limit(self) -> int:
        """Longest context the engine accepts for this model."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def layer_params(self) -> int:
        """Matmul parameters of one decoder layer (attention + gated MLP), biases included."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        if self.qkv_bias:
            attention += q + 2 * kv
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def norm_params(self) -> int:
        per_layer = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return self.num_layers * per_layer + self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head (one table when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.norm_params


def _spec(name: str, model_type: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
          vocab: int, max_len: int, tied: bool, head_dim: int | None = None) -> ModelSpec:
    return ModelSpec(name, model_type, hidden, layers, heads, kv_heads, head_dim or hidden // heads, intermediate,
                     vocab, max_len, tied, qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")


# Values of each base checkpoint's config.json on the Hugging Face hub.
CATALOG: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _spec("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 8192, 128256, 131072, True, head_dim=64),
    _spec("Llama-3.2-3B", "llama", 3072, 28, 24, 8, 8192, 128256, 131072, True, head_dim=128),
    _spec("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 14336, 128256, 131072, False),
    _spec("Llama-3.1-70B", "llama", 8192, 80, 64, 8, 28672, 128256, 131072, False),
    _spec("Mistral-7B-v0.3", "mistral", 4096, 32, 32, 8, 14336, 32768, 32768, False),
    _spec("Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 18944, 152064, 131072, False),
    _spec("Qwen2.5-32B", "qwen2", 5120, 64, 40, 8, 27648, 152064, 131072, False),
    _spec("Qwen2.5-72B", "qwen2", 8192, 80, 64, 8, 29568, 152064, 131072, False),
    _spec("Qwen3-8B", "qwen3", 4096, 36, 32, 8, 12288, 151936, 40960, False, head_dim=128),
    _spec("Qwen3-32B", "qwen3", 5120, 64, 64, 8, 25600, 151936, 40960, False, head_dim=128),
)}


def spec_from_config(name: str, config: dict[str, Any]) -> ModelSpec:
    """A ``ModelSpec`` from a Llama-family ``config.json``; names the missing key when there is one."""
    try:
        model_type = str(config.get("model_type", "llama"))
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        use_window = model_type == "mistral" or bool(config.get("use_sliding_window", False))
        window = config.get("sliding_window") if use_window else None
        return ModelSpec(
            name=name,
            model_type=model_type,
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=None if window is None else int(window),
        )
    except KeyError as error:
        raise ValueError(f"model {name!r}: config.json has no {error.args[0]!r}") from error


def resolve_model(source: str) -> ModelSpec:
    """``source`` is a checkpoint directory, a hub id cached locally, or a catalog name (case-insensitive)."""
    path = Path(source).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"--model {source!r} is a directory without a config.json")
        return spec_from_config(path.name, json.loads(config.read_text()))
    by_lower = {name.lower(): spec for name, spec in CATALOG.items()}
    short = source.rsplit("/", 1)[-1].lower()
    cached = cached_hub_config(source) if "/" in source else None
    if cached is not None:
        return spec_from_config(source, json.loads(cached.read_text()))
    if short in by_lower:
        return by_lower[short]
    raise ValueError(
        f"--model {source!r} is not a checkpoint directory, a hub id with config.json in the local Hugging Face "
        f"cache ({hub_cache_dir()}), nor a catalog name: {', '.join(CATALOG)}"
    )


def cached_hub_config(repo_id: str) -> Path | None:
    """The cached ``config.json`` of ``repo_id``; never touches the network."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache_dir())
    except HFValidationError:
        return None
    return Path(found) if isinstance(found, str) else None


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub resolves it (HF_HUB_CACHE, else HF_HOME/hub), read at call time."""
    explicit = os.environ.get("HF_HUB_CACHE")
    if explicit:
        return Path(explicit)
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home) / "hub"
