"""The size of the KV cache, in one place: what the engine allocates and what the planner counts agree."""
from __future__ import annotations

# The KV budget on a CPU when kv_cache_memory_gb is not given.
CPU_KV_BUDGET_BYTES = 1 << 30


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, element_bytes: int) -> int:
    """K and V of one block in every layer: what the engine allocates per block
    (``ModelRunner.bytes_per_block``) and what ``pagedllm plan`` counts."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes
