"""Prompt-lookup (n-gram) proposals: guess a sequence's next tokens from its own earlier context.

For each sequence, find the longest suffix of its tokens (prompt and output), between
``prompt_lookup_max`` and ``prompt_lookup_min`` tokens long, that also occurs earlier, and
propose the up-to-``k`` tokens that followed that earlier occurrence (its most recent one
when several match equally long). Editing code or text, where the output copies spans
of the prompt, is where this pays.

Each sequence's tokens are mirrored in a numpy buffer that grows by the tokens appended
since the last call, so a step never copies a whole context; the search itself is a
vectorised comparison over the context, ``prompt_lookup_max`` passes over the candidates.
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np

from pagedllm.core.request import Sample

_MIN_CAPACITY = 256


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._buffers: dict[int, tuple[np.ndarray, int]] = {}  # seq id -> (tokens, how many are filled)

    def propose(self, seqs: Seq[Sample], max_tokens: Seq[int]) -> list[list[int]]:
        """Up to ``min(k, max_tokens[i])`` proposed tokens to follow each of ``seqs``' tokens."""
        proposals: list[list[int]] = []
        for seq, limit in zip(seqs, max_tokens):
            limit = min(limit, self.k)
            if limit < 1:
                proposals.append([])
                continue
            tokens = self._tokens_of(seq)
            proposals.append(lookup(tokens, self.min_n, self.max_n, limit))
        return proposals

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget finished sequences."""
        for seq_id in seq_ids:
            self._buffers.pop(seq_id, None)

    def _tokens_of(self, seq: Sample) -> np.ndarray:
        token_ids = seq.token_ids
        length = len(token_ids)
        buffer, filled = self._buffers.get(seq.seq_id, (None, 0))
        if buffer is None or filled > length or buffer.size < length:
            grown = np.empty(max(_MIN_CAPACITY, 2 * length), dtype=np.int64)
            if buffer is not None and filled <= length:
                grown[:filled] = buffer[:filled]
            else:
                filled = 0
            buffer = grown
        if filled < length:
            buffer[filled:length] = token_ids[filled:]
        self._buffers[seq.seq_id] = (buffer, length)
        return buffer[:length]


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-``k`` tokens that followed the latest earlier occurrence of ``tokens``' longest suffix
    of ``min_n``..``max_n`` tokens; [] when no suffix of ``min_n`` tokens occurred before."""
    length = tokens.size
    max_n = min(max_n, length - 1)  # the suffix must fit, with an earlier start, before itself
    if max_n < min_n:
        return []
    # ``ends``: where an earlier occurrence of the suffix could end (its last token equal to ours).
    ends = np.flatnonzero(tokens[min_n - 1 : length - 1] == tokens[length - 1]) + (min_n - 1)
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, max_n):
        starts = ends - back
        ok = alive & (starts >= 0)
        ok[ok] = tokens[starts[ok]] == tokens[length - 1 - back]
        alive = ok
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])
    return tokens[end + 1 : end + 1 + k].tolist()
