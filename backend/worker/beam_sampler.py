"""The best candidates of a beam group's step: top ``count`` over all its beams' next tokens.

As transformers' beam search does: each beam's log-softmax of its raw logits plus
the beam's cumulative log-probability, in float32, one ``topk`` over the
flattened ``[beams * vocab]`` scores.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.core.beam_search import BeamCandidate


def beam_candidates(logits: torch.Tensor, scores: Sequence[float], count: int) -> list[BeamCandidate]:
    """``logits`` is ``[beams, vocab]``; ``scores[i]`` the cumulative log-probability of beam i."""
    if logits.dim() != 2 or logits.shape[0] != len(scores):
        raise ValueError(f"logits must have shape [len(scores)={len(scores)}, vocab], got {tuple(logits.shape)}")
    vocab = logits.shape[1]
    running = torch.tensor(scores, dtype=torch.float32, device=logits.device)
    totals = torch.log_softmax(logits.float(), dim=-1) + running[:, None]
    values, indices = totals.view(-1).topk(min(count, totals.numel()))
    return [BeamCandidate(index // vocab, index % vocab, value)
            for value, index in zip(values.tolist(), indices.tolist())]
