"""Native Llama-family model code and checkpoint loading.

``load_model(dir, dtype, device, attention)`` returns a ``CausalLM`` whose
``forward(input_ids, positions, kv_caches, attn)`` runs a flat batch over the
paged KV cache and whose ``compute_logits(hidden)`` gives float32 logits.
"""
from pagedllm.models.architectures import SUPPORTED_ARCHITECTURES, ArchitectureTraits, resolve_architecture
from pagedllm.models.llama import CausalLM
from pagedllm.models.loader import load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "ArchitectureTraits", "CausalLM", "load_model", "resolve_architecture"]
