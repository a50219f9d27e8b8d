"""Paged-attention kernels: Triton-lang implementations and plain-torch references."""
from pagedllm.kernels.reference import copy_blocks_ref, unified_attention_ref, write_kv_ref

__all__ = ["copy_blocks_ref", "unified_attention_ref", "write_kv_ref"]
