"""Prompt-lookup (n-gram) proposals: guess a sequence's next tokens from its own earlier context.

For each sequence, find the longest suffix of its tokens (prompt and output), between
``prompt_lookup_max`` and ``prompt_lookup_min`` tokens long, that also occurs earlier, and
propose the up-to-``k`` tokens that followed that earlier occurrence (its most recent one
when several match equally long). Editing code or text, where the output copies spans
of the prompt, is where this pays.

Each sequence keeps a :class:`SuffixIndex`: for every n-gram of its tokens, where it last
ended. It grows by the tokens appended since the last call, so a step never scans a whole
context, and a proposal is at most one dictionary lookup per suffix length. A search over
the context in numpy cost more per step, because the engine calls it cache-cold after each
forward, and grew with the context. The price is paid once per token: a prompt is indexed
at its first proposal, and the index holds one entry per n-gram length per token.
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

from pagedllm.core.request import Sample


class SuffixIndex:
    """Where each n-gram (``min_n`` <= n <= ``max_n``) of a sequence's tokens last ended, counting every n-gram
    but those ending at its last token: those are the suffixes a proposal looks up, which must occur earlier."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first: the longest match wins
        self.length = 0  # tokens seen by ``extend``
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> its latest end; n is the key's length

    def extend(self, tokens: Seq[int]) -> None:
        """Index the n-grams ending before ``tokens``' last token that the previous call had not (``tokens``
        extends those it saw)."""
        for end in range(max(self.length - 1, 0), len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self._last_end[tuple(tokens[end + 1 - n : end + 1])] = end
        self.length = len(tokens)

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """The up-to-``k`` tokens that followed the latest earlier occurrence of ``tokens``' longest indexed
        suffix; [] when none occurred before. ``tokens`` are those the last ``extend`` saw."""
        length = len(tokens)
        for n in self.sizes:
            if n >= length:  # an earlier occurrence needs a token before the suffix
                continue
            end = self._last_end.get(tuple(tokens[length - n :]))
            if end is not None:
                return list(tokens[end + 1 : end + 1 + k])
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._indexes: dict[int, SuffixIndex] = {}  # by seq id

    def propose(self, seqs: Seq[Sample], max_tokens: Seq[int]) -> list[list[int]]:
        """Up to ``min(k, max_tokens[i])`` proposed tokens to follow each of ``seqs``' tokens."""
        proposals: list[list[int]] = []
        for seq, limit in zip(seqs, max_tokens):
            limit = min(limit, self.k)
            if limit < 1:
                proposals.append([])
                continue
            proposals.append(self._index_of(seq).propose(seq.token_ids, limit))
        return proposals

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget finished sequences."""
        for seq_id in seq_ids:
            self._indexes.pop(seq_id, None)

    def _index_of(self, seq: Sample) -> SuffixIndex:
        index = self._indexes.get(seq.seq_id)
        if index is None or index.length > len(seq.token_ids):  # new, or its tokens were cut: start over
            index = self._indexes[seq.seq_id] = SuffixIndex(self.min_n, self.max_n)
        index.extend(seq.token_ids)
        return index
