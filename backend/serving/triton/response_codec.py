"""Turn engine deltas into the output tensors of vllm_backend-compatible Triton responses.

Every response carries one entry per sample (``n`` of them) in ``text_output`` and
the other per-sample outputs, in sample order. Streaming: one response per engine
step with only the new text (``""`` for a sample that produced nothing this step).
Not streaming: one response at the end with each sample's whole text, prompt first
when asked. ``finish_reason`` is ``"None"`` for a sample still running, as vllm_backend
writes it. With ``sparse_additional_outputs`` (pagedllm's own input,
:class:`pagedllm.serving.triton.request_codec.ReturnFlags`), ``num_input_tokens`` comes with a
request's first response only and ``finish_reason`` only once a sample has finished. ``logprobs`` is, per sample, a JSON list with one object per new token:
``{token_id: {"logprob", "rank", "decoded_token"}}`` with the sampled token's entry first
(so a client can tell it from the alternatives), or ``"null"`` when the request asked
for no logprobs. A sampled token outside the requested top-k gets rank k + 1
(the engine does not compute its exact rank; clients such as Triton's OpenAI frontend
need an integer there). With ``sampling_parameters.prompt_logprobs``, one response (the
first after the prompt is computed; the only one when not streaming) also carries
``prompt_logprobs``: a JSON list with one such object per prompt token, the prompt's own
token first, and for the first prompt token only that token with ``logprob`` and ``rank`` null.

Beam search: the engine reports a beam request once, when the search ends, with the
``n`` best hypotheses whole (best first); so a streaming beam request gets a single
response holding the ``n`` texts, and ``cumulative_logprob`` is each hypothesis' sum
of token log-probabilities (before the length penalty).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedllm.engine.outputs import CompletionDelta, RequestOutput
from pagedllm.serving.triton.request_codec import GenerateRequest

Tensors = dict[str, np.ndarray]


@dataclass(slots=True)
class _Sample:
    text: str = ""
    num_tokens: int = 0
    cumulative_logprob: float | None = None  # set whenever the client asked for it (see request_codec)
    logprobs: list[dict[str, dict[str, object]]] = field(default_factory=list)
    finish_reason: str | None = None


class ResponseAssembler:
    """Per-request state that turns each ``RequestOutput`` into zero or one response's tensors."""

    def __init__(self, request: GenerateRequest, decode_token: Callable[[int], str]) -> None:
        self.request = request
        self._decode_token = decode_token
        self._samples = [_Sample() for _ in range(request.params.n)]
        self._num_input_tokens = 0
        self._input_tokens_sent = False  # sparse outputs: only the first response carries the count
        self._prompt_logprobs: bytes | None = None  # encoded, until a response carries it

    def add(self, output: RequestOutput) -> Tensors | None:
        """Record one engine step's output; returns the tensors to send now, or ``None``."""
        self._num_input_tokens = len(output.prompt_token_ids)
        if output.prompt_logprobs is not None:
            self._prompt_logprobs = self._prompt_entries(output.prompt_token_ids, output.prompt_logprobs)
        step = [_Sample() for _ in self._samples]
        for delta in output.outputs:
            self._absorb(self._samples[delta.index], delta)
            self._absorb(step[delta.index], delta)
        for total, new in zip(self._samples, step):
            new.cumulative_logprob = total.cumulative_logprob
            new.finish_reason = total.finish_reason
        if self.request.stream:
            return self._tensors(step, prefix="")
        if output.finished:
            return self._tensors(self._samples, prefix=self.request.prompt if self.request.prepend_input else "")
        return None

    def _absorb(self, sample: _Sample, delta: CompletionDelta) -> None:
        sample.text += delta.text
        sample.num_tokens += len(delta.token_ids)
        sample.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            sample.finish_reason = delta.finish_reason
        if delta.logprobs is not None:
            sample.logprobs.extend(self._logprob_entries(delta))

    def _logprob_entries(self, delta: CompletionDelta) -> list[dict[str, dict[str, object]]]:
        entries = []
        for sampled, candidates in zip(delta.token_ids, delta.logprobs or ()):
            # Ranks are positions among the returned entries: exact for the top-k, and k + 1 for a
            # sampled token listed beyond them.
            ranked = sorted(candidates.items(), key=lambda item: -item[1])
            entry = {
                str(token_id): {"logprob": logprob, "rank": position + 1, "decoded_token": self._decode_token(token_id)}
                for position, (token_id, logprob) in enumerate(ranked)
            }
            entries.append({str(sampled): entry[str(sampled)], **entry})  # the sampled token first
        return entries

    def _prompt_entries(self, prompt_token_ids: Sequence[int],
                        prompt_logprobs: Sequence[dict[int, float] | None]) -> bytes:
        first = {str(prompt_token_ids[0]): {"logprob": None, "rank": None,
                                            "decoded_token": self._decode_token(prompt_token_ids[0])}}
        later = self._logprob_entries(CompletionDelta(
            index=0, text="", token_ids=tuple(prompt_token_ids[1:]), cumulative_logprob=None,
            logprobs=tuple(entry or {} for entry in prompt_logprobs[1:]), finish_reason=None))
        return json.dumps([first, *later]).encode()

    def _tensors(self, samples: list[_Sample], prefix: str) -> Tensors:
        tensors: Tensors = {
            "text_output": np.array([(prefix + s.text).encode("utf-8") for s in samples], dtype=np.object_),
        }
        returns = self.request.returns
        if returns.finish_reason and (not returns.sparse or any(s.finish_reason is not None for s in samples)):
            tensors["finish_reason"] = np.array([str(s.finish_reason).encode() for s in samples], dtype=np.object_)
        if returns.cumulative_logprob:
            tensors["cumulative_logprob"] = np.array([s.cumulative_logprob for s in samples], dtype=np.float32)
        if returns.logprobs:
            wanted = self.request.logprobs_requested and self.request.params.logprobs is not None
            tensors["logprobs"] = np.array(
                [(json.dumps(s.logprobs) if wanted else "null").encode() for s in samples], dtype=np.object_)
        if returns.num_input_tokens and not (returns.sparse and self._input_tokens_sent):
            tensors["num_input_tokens"] = np.array([self._num_input_tokens], dtype=np.uint32)
            self._input_tokens_sent = True
        if returns.num_output_tokens:
            tensors["num_output_tokens"] = np.array([s.num_tokens for s in samples], dtype=np.uint32)
        if self._prompt_logprobs is not None:
            tensors["prompt_logprobs"] = np.array([self._prompt_logprobs], dtype=np.object_)
            self._prompt_logprobs = None
        return tensors


def merge_tensors(chunks: Sequence[Tensors]) -> Tensors:
    """Combine consecutive streaming responses of one request into the one response they add up to.

    Texts and logprob lists are concatenated and token counts summed per sample; the
    rest (finish reasons, cumulative logprobs) is taken from the last, and what only one
    chunk may carry (prompt logprobs; the prompt length, with sparse outputs) from the first
    that does.
    """
    merged = dict(chunks[-1])
    if len(chunks) == 1:
        return merged
    for name in ("prompt_logprobs", "num_input_tokens"):
        carried = [c[name] for c in chunks if name in c]
        if carried:
            merged[name] = carried[0]
    merged["text_output"] = np.array([b"".join(parts) for parts in zip(*(c["text_output"] for c in chunks))],
                                     dtype=np.object_)
    if "num_output_tokens" in merged:
        merged["num_output_tokens"] = np.sum([c["num_output_tokens"] for c in chunks], axis=0, dtype=np.uint32)
    if "logprobs" in merged:
        per_sample = zip(*(c["logprobs"] for c in chunks))
        merged["logprobs"] = np.array([_concat_json_lists(parts) for parts in per_sample], dtype=np.object_)
    return merged


def _concat_json_lists(parts: Sequence[bytes]) -> bytes:
    if all(part == b"null" for part in parts):
        return b"null"
    return json.dumps([entry for part in parts for entry in json.loads(part)]).encode()
