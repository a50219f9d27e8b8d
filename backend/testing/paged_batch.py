"""Random paged-attention inputs, shared by the kernel tests and ``pagedllm bench kernels``."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """The arguments of ``unified_attention`` for one batch."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq + spare columns]
    scale: float

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_table, self.scale)


def random_paged_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    spare_columns: int = 0,
) -> PagedBatch:
    """Random queries and cache; each sequence's blocks are a random permutation of the pool.

    ``spare_columns`` extra block-table columns point at an unrelated block, as a
    runner padding rows to a common width would produce.
    """
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    block_table = torch.full((len(seq_lens), max(blocks_per_seq) + spare_columns), int(order[-1]),
                             dtype=torch.int32, device=device)
    used = 0
    for row, count in enumerate(blocks_per_seq):
        block_table[row, :count] = order[used:used + count]
        used += count

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        q=randn(sum(query_lens), num_heads, head_dim),
        k_cache=randn(*cache_shape),
        v_cache=randn(*cache_shape),
        query_start_loc=torch.tensor((0, *query_lens), device=device).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        scale=head_dim ** -0.5,
    )
