"""Incremental detokenization of one sample, with stop strings.

Text comes from tokenizers' ``DecodeStream``, which emits a chunk only once the
bytes decode to whole characters, and reproduces the spacing that decoding the
prompt and output together would give. On top of that this module finds stop
strings (also across token boundaries), truncates at them, and holds back text
that could still turn out to be the start of a stop string.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from pagedllm.core.sampling_params import SamplingParams

# Priming needs only enough prompt tokens to settle the spacing and any
# character the prompt leaves unfinished; decoding the whole prompt would cost
# time proportional to its length for every sample.
_PRIME_WINDOW = 32
_REPLACEMENT = "\ufffd"


# Not frozen, like the other records built per token per step: a frozen __init__ costs several times more.
@dataclass(slots=True)
class DetokenizerUpdate:
    text: str  # new text to emit now
    stop_string: str | None  # the stop string that matched; the sample is then finished


class IncrementalDetokenizer:
    """Turns one sample's new token ids into text deltas, step by step.

    With stop strings, ``_text`` is all text decoded so far, after stop-string
    truncation, including any part still held back from the deltas. Without
    them nothing is held back, so each chunk goes straight out and ``_text``
    only receives what ``flush()`` decodes at the end. Either way, the deltas
    concatenated (plus ``flush()``) are the sample's whole text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ValueError(f"tokenizer must be a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")
        self._backend = backend
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0  # counted only with stop strings, for min_tokens
        # The ids fed to the stream (the last few it turned into text, then those it holds back),
        # and how many of them it has turned into text: only flush() reads them, to decode a
        # sample that ends mid-character.
        self._ids = list(prompt_token_ids[-_PRIME_WINDOW:])
        self._num_decoded = 0
        self._stream = self._primed_stream()
        self._emitted = 0
        self._finished = False
        self._text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=self._skip_special)

    def _primed_stream(self) -> DecodeStream:
        """A stream whose next chunk continues the prompt's text.

        If the prompt ends inside a character, the stream is primed with the
        longest clean prefix and the rest is fed as pending, so the first output
        token that completes the character emits it whole.
        """
        window = self._ids
        clean = next(k for k in range(len(window), -1, -1) if not self._decode(window[:k]).endswith(_REPLACEMENT))
        stream = DecodeStream(ids=window[:clean] or None, skip_special_tokens=self._skip_special)
        self._num_decoded = clean
        if clean < len(window):
            stream.step(self._backend, window[clean:])
        return stream

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Feed one step's new ids; return the text that may be emitted now."""
        if self._finished:
            raise ValueError("update() called after the sample finished (stop string or flush)")
        text = "".join([self._feed(token_id) for token_id in new_token_ids])
        if not self._stops:  # nothing to find or hold back: all of it goes out now
            return DetokenizerUpdate(text, None)
        self._num_tokens += len(new_token_ids)
        previous_length = len(self._text)
        self._text += text

        # As in vLLM, stop strings count only once min_tokens tokens are out.
        if self._num_tokens > self._min_tokens:
            match = self._find_stop(previous_length)
            if match is not None:
                stop, start = match
                self._text = self._text[: start + len(stop) if self._include_stop else start]
                self._finished = True
                return DetokenizerUpdate(self._release(len(self._text)), stop)
        return DetokenizerUpdate(self._release(len(self._text) - self._held_back()), None)

    def feed(self, token_id: int) -> str:
        """``update((token_id,)).text`` for a sample without stop strings, without building a record:
        the per-token path of most samples."""
        if self._stops or self._finished:
            raise ValueError("feed() is for live samples without stop strings; use update()")
        return self._feed(token_id)

    def _feed(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        chunk = self._stream.step(self._backend, token_id)
        if chunk is None:
            return ""
        self._num_decoded = len(ids)
        if self._num_decoded > 2 * _PRIME_WINDOW:  # keep only the context flush() may need
            del ids[: self._num_decoded - _PRIME_WINDOW]
            self._num_decoded = _PRIME_WINDOW
        return chunk

    def flush(self) -> str:
        """Release everything held back, when the sample ends for a reason other than a stop string.

        A sample that ends inside a character gets the replacement character(s)
        that ``tokenizer.decode`` would give for those bytes.
        """
        if self._num_decoded < len(self._ids) and not self._finished:
            context = self._ids[max(0, self._num_decoded - _PRIME_WINDOW) : self._num_decoded]
            with_pending = self._decode(context + self._ids[self._num_decoded :])
            self._text += with_pending[len(self._decode(context)):]
            self._num_decoded = len(self._ids)
        self._finished = True
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        text = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return text

    def _find_stop(self, previous_length: int) -> tuple[str, int] | None:
        """The earliest stop string that ends inside the text added this step."""
        best: tuple[str, int] | None = None
        for stop in self._stops:
            start = self._text.find(stop, max(0, previous_length - len(stop) + 1))
            if start != -1 and (best is None or start < best[1]):
                best = (stop, start)
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a later step could extend into a stop string.

        With ``include_stop_str_in_output`` the stop string is emitted anyway,
        so nothing needs holding back.
        """
        if self._include_stop:
            return 0
        text = self._text
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
