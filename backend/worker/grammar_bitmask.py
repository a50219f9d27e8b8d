"""The step's token bitmask for its constrained rows: filled by their matchers, applied to their logits.

One int32 bitmask (xgrammar's layout: a bit per vocabulary id, 32 ids a word) sized for
``max_rows`` rows is allocated once. Each step the constrained rows' matchers fill their
rows in one batched xgrammar call, and xgrammar's kernel sets every disallowed logit of
those rows to ``-inf``; the other rows are not read or written. The mask goes on before
penalties and sampling, so logprobs are those of the constrained distribution, as in vLLM.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class GrammarBitmask:
    def __init__(self, vocab_size: int, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[xgr.GrammarMatcher]) -> None:
        """Mask ``logits[rows[i]]`` (in place) to what ``matchers[i]`` allows next."""
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must have shape [rows, {self.vocab_size}], got {tuple(logits.shape)}")
        if len(rows) != len(matchers):
            raise ValueError(f"{len(rows)} rows for {len(matchers)} matchers")
        if logits.shape[0] > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        # xgrammar's row indices address the logits and the bitmask alike.
        bitmask = self._bitmask[: logits.shape[0]]
        indices = list(rows)
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, indices)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=indices)
