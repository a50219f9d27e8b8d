"""How a step's outputs cross the pipe from the engine core process to the stub: plain tuples.

Pickling the slotted ``RequestOutput`` / ``CompletionDelta`` dataclasses goes through
``copyreg`` once per object, a visible share of the engine core's step at a big decode
batch. Tuples of their fields pickle several times faster, and the parent rebuilds the
dataclasses in about the time unpickling them took before (measured: RESULTS.md,
"Figures behind the code's choices"). The prompt stays out: the parent has it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedllm.engine.outputs import CompletionDelta, RequestOutput

DeltaRow = tuple[int, str, tuple[int, ...], float | None, tuple[dict[int, float], ...] | None, str | None, float | None]
OutputRow = tuple[str, tuple[DeltaRow, ...], bool, str | None, list[dict[int, float] | None] | None, bool]


def encode_outputs(outputs: Sequence[RequestOutput]) -> list[OutputRow]:
    return [(output.request_id,
             tuple((d.index, d.text, d.token_ids, d.cumulative_logprob, d.logprobs, d.finish_reason, d.score)
                   for d in output.outputs),
             output.finished, output.error, output.prompt_logprobs, output.invalid_input)
            for output in outputs]


def decode_outputs(rows: Sequence[OutputRow],
                   prompts: Mapping[str, tuple[str | None, tuple[int, ...]]]) -> list[RequestOutput]:
    """The step's ``RequestOutput``s, each with its request's prompt from ``prompts`` (by request id)."""
    outputs = []
    for request_id, deltas, finished, error, prompt_logprobs, invalid_input in rows:
        prompt, prompt_token_ids = prompts.get(request_id, (None, ()))
        outputs.append(RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                     outputs=tuple(CompletionDelta(*delta) for delta in deltas), finished=finished,
                                     error=error, prompt_logprobs=prompt_logprobs, invalid_input=invalid_input))
    return outputs
