"""Ending a cancelled request: each of its samples finishes with "abort", and each of its ``n`` outputs says so."""
from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.request import Request, Sample, SampleStatus
from pagedllm.engine.outputs import CompletionDelta


def abort_request(request: Request, held: Sample | None, finish: Callable[[Sample, str], None],
                  release: Callable[[Sample], str]) -> list[CompletionDelta]:
    """The deltas that end ``request``. ``held``: its sample when it was cancelled while its grammar compiled
    (it never reached the scheduler); ``finish`` ends a scheduled sample, ``release`` drops a sample's output
    state and returns the text it still held back. Outputs that had already finished get no delta."""
    if held is not None:
        held.status, held.finish_reason = SampleStatus.FINISHED, "abort"
        return [_aborted(index, None) for index in range(request.params.n)]
    if request.params.use_beam_search:
        for seq in request.sequences:
            finish(seq, "abort")
        return [_aborted(index, 0.0) for index in range(request.params.n)]
    live = {seq.index: seq for seq in request.sequences if not seq.is_finished}
    reports_logprob = request.params.logprobs is not None  # as every other delta of the request
    deltas: list[CompletionDelta] = []
    for index in range(request.params.n):
        seq = live.get(index)
        if seq is None and index < len(request.sequences):
            continue
        text, logprob = "", 0.0
        if seq is not None:
            finish(seq, "abort")
            text, logprob = release(seq), seq.cumulative_logprob
        deltas.append(CompletionDelta(index=index, text=text, token_ids=(),
                                      cumulative_logprob=logprob if reports_logprob else None, logprobs=None,
                                      finish_reason="abort"))
    return deltas


def _aborted(index: int, cumulative_logprob: float | None) -> CompletionDelta:
    return CompletionDelta(index=index, text="", token_ids=(), cumulative_logprob=cumulative_logprob, logprobs=None,
                           finish_reason="abort")
