"""Native Llama-family model code and checkpoint loading.

``load_model(dir, dtype, device, attention)`` returns a ``CausalLM`` whose
``forward(input_ids, positions, kv_caches, attn)`` runs a flat batch over the
paged KV cache and whose ``compute_logits(hidden)`` gives float32 logits.
"""
from __future__ import annotations

from pagedllm.platform.lazy_exports import lazy_exports

# Resolved on first use, so importing a light module of this package (the architecture table)
# does not load torch and the whole model.
_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": "pagedllm.models.architectures",
    "ArchitectureTraits": "pagedllm.models.architectures",
    "resolve_architecture": "pagedllm.models.architectures",
    "CausalLM": "pagedllm.models.llama",
    "load_model": "pagedllm.models.loader",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
