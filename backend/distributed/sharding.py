"""The tensor-parallel sharding rules, in one place: the model code, the loader and ``pagedllm plan`` all ask here.

Megatron-style: q|k|v and gate|up are split by output rows (column-parallel),
o_proj and down_proj by input columns (row-parallel, one all-reduce after each),
the embedding and the LM head by vocabulary rows. Query heads must divide
evenly; KV heads are split when there are at least as many as ranks, else each
is replicated on ``tp / num_kv_heads`` ranks (vLLM's rule). The vocabulary is
padded up to a multiple of the rank count, so every rank holds an equal slice.

Pure arithmetic without torch: the planner imports it too.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RowRange:
    """Rows ``[start, stop)`` of a checkpoint tensor's dimension ``dim``, zero-padded to ``padded`` rows."""

    dim: int
    start: int
    stop: int
    padded: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The hyperparameters sharding depends on (from a Hugging Face config or the planner's catalog)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What rank ``rank`` of ``size`` holds of a model of shape ``shape``; :func:`shard_layout` validates."""

    shape: ModelShape
    rank: int
    size: int

    @property
    def num_heads(self) -> int:
        return self.shape.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.shape.num_kv_heads // self.size)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 unless there are more ranks than KV heads)."""
        return max(1, self.size // self.shape.num_kv_heads)

    @property
    def intermediate_size(self) -> int:
        return self.shape.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.shape.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_stop(self) -> int:
        return min(self.shape.vocab_size, self.vocab_start + self.vocab_per_rank)

    def q_rows(self) -> RowRange:
        width = self.num_heads * self.shape.head_dim
        return RowRange(0, self.rank * width, (self.rank + 1) * width, width)

    def kv_rows(self) -> RowRange:
        """This rank's rows of k_proj (and v_proj): its own KV heads, or the one it shares with its replicas."""
        first_head = self.rank // self.kv_replicas * self.num_kv_heads
        width = self.num_kv_heads * self.shape.head_dim
        start = first_head * self.shape.head_dim
        return RowRange(0, start, start + width, width)

    def o_columns(self) -> RowRange:
        rows = self.q_rows()
        return RowRange(1, rows.start, rows.stop, rows.padded)

    def mlp_rows(self) -> RowRange:
        """gate_proj / up_proj rows (and, on dim 1, down_proj columns)."""
        width = self.intermediate_size
        return RowRange(0, self.rank * width, (self.rank + 1) * width, width)

    def down_columns(self) -> RowRange:
        rows = self.mlp_rows()
        return RowRange(1, rows.start, rows.stop, rows.padded)

    def vocab_rows(self) -> RowRange:
        return RowRange(0, self.vocab_start, self.vocab_stop, self.vocab_per_rank)


def shard_layout(shape: ModelShape, rank: int, size: int) -> ShardLayout:
    """The layout of ``rank`` in a group of ``size``; ``ValueError`` naming what a size cannot split."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} is invalid: expected a positive integer")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
    if shape.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {shape.num_heads} attention heads "
                         "(num_attention_heads)")
    if shape.num_kv_heads % size and size % shape.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and the model's {shape.num_kv_heads} KV heads "
                         "(num_key_value_heads): one must divide the other")
    if shape.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's intermediate_size="
                         f"{shape.intermediate_size}")
    return ShardLayout(shape, rank, size)

