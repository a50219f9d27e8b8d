"""A beam search's part of a step: the candidates its live beams propose, and its hypotheses once it ends.

Beams rewrite earlier tokens, so a beam search has no per-step deltas: its ``n`` best hypotheses are decoded
whole when it is done.
"""
from __future__ import annotations

import torch

from pagedllm.core.beam_search import BeamCandidate, BeamSearch
from pagedllm.core.request import Request
from pagedllm.core.scheduler import BeamBatch
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import CompletionDelta
from pagedllm.worker.beam_sampler import beam_candidates


def beam_search_of(request: Request) -> BeamSearch:
    if request.beam_search is None:
        raise RuntimeError(f"request {request.request_id} is not a beam search")
    return request.beam_search


def beam_step_candidates(logits: torch.Tensor, batch: BeamBatch) -> list[BeamCandidate]:
    """The best candidates over ``batch``'s live beams, from their rows of the step's logits."""
    search = beam_search_of(batch.request)
    rows = torch.tensor(batch.logit_rows, device=logits.device, dtype=torch.long)
    return beam_candidates(logits[rows], search.scores, search.num_candidates)


def finished_beam_outputs(outputs: OutputProcessor, request: Request, search: BeamSearch) -> list[CompletionDelta]:
    """The ``n`` best hypotheses of a finished beam search, best first, whole."""
    return [
        CompletionDelta(index=index, text=outputs.decode(request, hyp.token_ids, hyp.finish_reason),
                        token_ids=hyp.token_ids, cumulative_logprob=hyp.cumulative_logprob, logprobs=None,
                        finish_reason=hyp.finish_reason, score=hyp.score)
        for index, hyp in enumerate(search.best(request.params.n))
    ]
