"""The model side of tensor parallelism: where a parameter's rows come from, and the vocabulary-split layers.

The split itself (which heads, rows and vocabulary a rank holds) is decided in
:mod:`pagedllm.distributed.sharding`; this module turns it into checkpoint reads
(:class:`TensorPart`) and into the two layers whose forward changes with it.
At one rank the parts cover whole tensors and the layers are plain lookups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.layers.norm_rotary import head_dim_of
from pagedllm.distributed.group import TensorParallel
from pagedllm.distributed.sharding import ModelShape, RowRange, ShardLayout


@dataclass(frozen=True, slots=True)
class TensorPart:
    """One checkpoint tensor, or the rows of it this rank holds (``rows=None``: all of it)."""

    name: str
    rows: RowRange | None = None


@dataclass(frozen=True, slots=True)
class ParameterSource:
    """A parameter's checkpoint parts, concatenated along dim 0 in order (q|k|v, gate|up).

    ``stack`` > 0: the concatenation is that many equal blocks stacked on a new first dimension (a layer's
    experts: ``[E, rows, cols]``).
    """

    parts: tuple[TensorPart, ...]
    stack: int = 0


def model_shape(config: PretrainedConfig) -> ModelShape:
    """The hyperparameters the sharding rules read, from a transformers config."""
    return ModelShape(
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim_of(config),
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
    )


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split by vocabulary: each rank looks up its own ids, one all-reduce sums them."""

    def __init__(self, layout: ShardLayout, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden_size), requires_grad=False)
        self.start = layout.vocab_start
        self.stop = layout.vocab_stop
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        local = (input_ids - self.start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


def gather_vocab(logits: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor | None:
    """Rank 0: the whole vocabulary's logits from every rank's slice (padding rows dropped); others: ``None``."""
    full = tp.gather_columns(logits)
    if full is None:
        return None
    return full if full.shape[-1] == vocab_size else full[..., :vocab_size]
