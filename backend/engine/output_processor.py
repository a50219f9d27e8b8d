"""Turns each sample's new token into a text delta: detokenization and stop strings.

The scheduler ends samples at token-level stops (EOS, stop ids, lengths); stop
strings are text, so they are found here and reported back to the engine,
which ends the sample. One incremental detokenizer per live sequence.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from pagedllm.core.request import Request, Sample
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.outputs import CompletionDelta
from pagedllm.worker.sampler import SampledToken


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}

    def add(self, seq: Sample) -> None:
        """Start decoding a new sample (its output is empty: forks happen before the first token)."""
        request = seq.request
        self._detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                                request.params)

    def process(self, seq: Sample, token: SampledToken, last: bool = True) -> CompletionDelta:
        """The delta for ``token``, just appended to ``seq`` (which the scheduler may already have finished).

        Its finish reason is "stop" when a stop string ended the sample; the engine must then end it.
        ``last=False``: a token of a verified speculative run that others follow, so the sample's
        finish reason (set by a later token) is not its own.
        """
        params = seq.request.params
        detokenizer = self._detokenizers[seq.seq_id]
        reason = seq.finish_reason if last else None
        if reason is None and not params.stop:  # most tokens: no stop string to find, nothing to flush
            text = detokenizer.feed(token.token_id)
        else:
            text, reason = self._text_at_stops(reason, seq, detokenizer, token.token_id)
            if reason is not None:
                del self._detokenizers[seq.seq_id]
        if params.logprobs is None:
            return CompletionDelta(index=seq.index, text=text, token_ids=(token.token_id,), cumulative_logprob=None,
                                   logprobs=None, finish_reason=reason)
        logprobs = (token.top_logprobs or {},)
        return CompletionDelta(index=seq.index, text=text, token_ids=(token.token_id,),
                               cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs, finish_reason=reason)

    @staticmethod
    def _text_at_stops(reason: str | None, seq: Sample, detokenizer: IncrementalDetokenizer,
                       token_id: int) -> tuple[str, str | None]:
        """The text and finish reason of a token that ends its sample (``reason``) or may complete a stop string."""
        stop_string = None
        # As in vLLM, the EOS / stop token that ends a sample is not part of its text.
        if reason == "stop" and not seq.request.params.include_stop_str_in_output:
            text = ""
        else:
            update = detokenizer.update((token_id,))
            text, stop_string = update.text, update.stop_string
        if stop_string is not None:
            reason = "stop"
        elif reason is not None:
            text += detokenizer.flush()
        return text, reason

    def decode(self, request: Request, token_ids: tuple[int, ...], finish_reason: str) -> str:
        """The whole text of a finished beam hypothesis; as for samples, a stop token is not part of it."""
        if finish_reason == "stop" and not request.params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params)
        return detokenizer.update(token_ids).text + detokenizer.flush()

    def close(self, seq: Sample) -> str:
        """Release a sample that ends without a new token (abort, error); returns its held-back text."""
        detokenizer = self._detokenizers.pop(seq.seq_id, None)
        return "" if detokenizer is None else detokenizer.flush()
