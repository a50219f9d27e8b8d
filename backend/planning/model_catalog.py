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
    model_type: str  # llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe
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
    # Mixtures of experts (0 experts: a dense model). A sparse layer holds num_experts gated MLPs of
    # expert_intermediate_size, a router, and (Qwen2-MoE) a shared expert behind a 1-wide sigmoid gate.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_dense_layers: int = 0  # MoE layers that keep the dense MLP of intermediate_size instead

    @property
    def context_limit(self) -> int:
        """Longest context the engine accepts for this model."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def attention_params(self) -> int:
        """Matmul parameters of one decoder layer's attention, biases included."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        if self.qkv_bias:
            attention += q + 2 * kv
        return attention

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_sparse_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def expert_params(self) -> int:
        """One expert of one sparse layer (gate, up and down)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def mlp_params(self) -> int:
        """Every layer's gated MLP or MoE block (experts, router, shared expert and its gate)."""
        dense = 3 * self.hidden_size * self.intermediate_size
        if not self.is_moe:
            return self.num_layers * dense
        shared = 3 * self.hidden_size * self.shared_expert_intermediate_size
        shared += self.hidden_size if self.shared_expert_intermediate_size else 0
        sparse = self.num_experts * (self.expert_params + self.hidden_size) + shared
        return self.num_dense_layers * dense + self.num_sparse_layers * sparse

    @property
    def idle_expert_params(self) -> int:
        """Expert parameters a single token does not use: the unchosen experts of every sparse layer."""
        return self.num_sparse_layers * (self.num_experts - self.experts_per_token) * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token computes with (the public "A3B"-style figure: embeddings included)."""
        return self.num_params - self.idle_expert_params

    def experts_touched(self, num_tokens: int) -> float:
        """Expected distinct experts a sparse layer runs for ``num_tokens`` tokens; 0 for a dense model."""
        return expected_experts_touched(self.num_experts, self.experts_per_token, num_tokens)

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
        return self.num_layers * self.attention_params + self.mlp_params + self.embedding_params + self.norm_params


def expected_experts_touched(num_experts: int, experts_per_token: int, num_tokens: int) -> float:
    """``E (1 - (1 - k/E)^b)``: distinct experts that ``b`` tokens choosing ``k`` of ``E`` each touch, in
    expectation, when each token's choice is independent and uniform (real routers are skewed: an upper bound)."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** max(0, num_tokens))


def _spec(name: str, model_type: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
          vocab: int, max_len: int, tied: bool, head_dim: int | None = None, experts: tuple[int, int, int] = (0, 0, 0)
          ) -> ModelSpec:
    """``experts``: (num_experts, experts_per_token, expert_intermediate_size) of a mixture of experts."""
    num_experts, per_token, expert_size = experts
    return ModelSpec(name, model_type, hidden, layers, heads, kv_heads, head_dim or hidden // heads, intermediate,
                     vocab, max_len, tied, qkv_bias=model_type in ("qwen2", "qwen2_moe"),
                     qk_norm=model_type in ("qwen3", "qwen3_moe"), num_experts=num_experts,
                     experts_per_token=per_token, expert_intermediate_size=expert_size)


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
    # Mixtral's intermediate_size is each expert's; the Qwen MoE models have no dense layers.
    _spec("Mixtral-8x7B", "mixtral", 4096, 32, 32, 8, 14336, 32000, 32768, False, experts=(8, 2, 14336)),
    _spec("Qwen3-30B-A3B", "qwen3_moe", 2048, 48, 32, 4, 6144, 151936, 40960, False, head_dim=128,
          experts=(128, 8, 768)),
    _spec("Qwen3-235B-A22B", "qwen3_moe", 4096, 94, 64, 4, 12288, 151936, 40960, False, head_dim=128,
          experts=(128, 8, 1536)),
)}


def spec_from_config(name: str, config: dict[str, Any]) -> ModelSpec:
    """A ``ModelSpec`` from a Llama-family ``config.json``; names the missing key when there is one."""
    try:
        model_type = str(config.get("model_type", "llama"))
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        use_window = model_type in ("mistral", "mixtral") or bool(config.get("use_sliding_window", False))
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
            qkv_bias=(model_type == "qwen2" or bool(config.get("attention_bias", False))
                      or (model_type == "qwen2_moe" and bool(config.get("qkv_bias", True)))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=None if window is None else int(window),
            **_experts_from_config(model_type, config),
        )
    except KeyError as error:
        raise ValueError(f"model {name!r}: config.json has no {error.args[0]!r}") from error


def _experts_from_config(model_type: str, config: dict[str, Any]) -> dict[str, int]:
    """The MoE fields of a Mixtral or Qwen MoE ``config.json`` (dense layers by transformers' rule); ``{}`` else."""
    if model_type == "mixtral":
        return {"num_experts": int(config["num_local_experts"]),
                "experts_per_token": int(config["num_experts_per_tok"]),
                "expert_intermediate_size": int(config["intermediate_size"])}
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    layers, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    # transformers 5 writes Qwen3-MoE's count as num_local_experts; the hub's configs say num_experts.
    num_experts = int(config["num_experts"] if "num_experts" in config else config["num_local_experts"])
    sparse = sum(1 for i in range(layers) if i not in dense_only and num_experts > 0 and (i + 1) % step == 0)
    return {"num_experts": num_experts if sparse else 0, "experts_per_token": int(config["num_experts_per_tok"]),
            "expert_intermediate_size": int(config["moe_intermediate_size"]),
            "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0)
            if model_type == "qwen2_moe" else 0,
            "num_dense_layers": layers - sparse}


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
