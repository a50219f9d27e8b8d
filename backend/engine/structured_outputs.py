"""The engine's constrained samples: requests held while their grammar compiles, one matcher per sample.

A request with ``structured_outputs`` is held here, outside the scheduler, until its
grammar has compiled (:class:`GrammarCompiler`, on a worker thread); every other request
keeps stepping meanwhile. A constraint xgrammar rejects, or one still compiling after
``compile_timeout_s``, fails that request alone (``StructuredOutputFailure``).

Once scheduled, each sample (each of ``n``) has its own ``GrammarMatcher``, keyed by
sequence id, so preemption (which only drops KV blocks) leaves its state as it was.
Each step the matchers of the constrained rows fill one bitmask that masks their logits
(:class:`GrammarBitmask`); after sampling, each matcher advances with its token. A
matcher that has terminated (it accepted a stop token where the grammar may end) ends
its sample with reason ``stop``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagedllm.core.request import Request, Sample
from pagedllm.engine.grammar_compiler import GrammarCompiler, GrammarRejected
from pagedllm.worker.grammar_bitmask import GrammarBitmask


@dataclass(frozen=True, slots=True)
class StructuredOutputFailure:
    """A held request that cannot run: its sequence, and why (naming ``structured_outputs``)."""

    seq: Sample
    message: str


@dataclass(frozen=True, slots=True)
class _Held:
    seq: Sample
    grammar: Future[xgr.CompiledGrammar]
    deadline: float


class StructuredOutputs:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: frozenset[int],
                 compile_timeout_s: float, max_rows: int) -> None:
        self.compile_timeout_s = compile_timeout_s
        self._compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self._vocab_size = vocab_size
        self._max_rows = max_rows
        self._bitmask: GrammarBitmask | None = None
        self._held: dict[str, _Held] = {}
        # Per constrained sample: its matcher and the compiled grammar its siblings start from.
        self._matchers: dict[int, tuple[xgr.GrammarMatcher, xgr.CompiledGrammar]] = {}

    # ---- compiling ----

    def hold(self, seq: Sample) -> None:
        """Keep ``seq`` (a request's first sample) until its grammar has compiled."""
        constraint = seq.request.params.structured_outputs
        if constraint is None:
            raise ValueError(f"request {seq.request.request_id} has no structured_outputs to compile")
        future = self._compiler.submit(constraint)
        self._held[seq.request.request_id] = _Held(seq, future, time.monotonic() + self.compile_timeout_s)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def drop(self, request_id: str) -> Sample | None:
        """Stop holding a request (aborted while compiling); its sequence, or None if it is not held."""
        held = self._held.pop(request_id, None)
        return None if held is None else held.seq

    def take_compiled(self) -> tuple[list[Sample], list[StructuredOutputFailure]]:
        """The held sequences whose grammar is ready (to schedule now), and those that failed."""
        if not self._held:
            return [], []
        ready: list[Sample] = []
        failed: list[StructuredOutputFailure] = []
        now = time.monotonic()
        for request_id, held in list(self._held.items()):
            if held.grammar.done():
                del self._held[request_id]
                error = held.grammar.exception()
                if error is None:
                    self._matchers[held.seq.seq_id] = self._new_matcher(held.grammar.result())
                    ready.append(held.seq)
                else:
                    failed.append(StructuredOutputFailure(held.seq, _failure_message(error)))
            elif now >= held.deadline:
                del self._held[request_id]
                constraint = held.seq.request.params.structured_outputs
                kind = "" if constraint is None else f".{constraint.kind}"
                failed.append(StructuredOutputFailure(held.seq, (
                    f"SamplingParams.structured_outputs{kind} did not compile within {self.compile_timeout_s:g} s "
                    "(structured_outputs_compile_timeout_s)")))
        return ready, failed

    def wait(self, limit_s: float) -> None:
        """Sleep until a held grammar is ready or a deadline passes (at most ``limit_s``): nothing else runs."""
        if not self._held:
            return
        nearest = min(held.deadline for held in self._held.values()) - time.monotonic()
        wait([held.grammar for held in self._held.values()], max(0.0, min(limit_s, nearest)),
             return_when=FIRST_COMPLETED)

    def close(self) -> None:
        self._compiler.close()

    # ---- sampling ----

    def track(self, seq: Sample) -> None:
        """A constrained request's new sample (``n > 1`` forks at the first token) gets a matcher of its own."""
        if seq.request.params.structured_outputs is None or seq.seq_id in self._matchers:
            return
        first = seq.request.sequences[0]
        _, grammar = self._matchers[first.seq_id]
        self._matchers[seq.seq_id] = self._new_matcher(grammar)

    def release(self, seq_ids: Seq[int]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    @property
    def has_matchers(self) -> bool:
        return bool(self._matchers)

    def mask(self, logits: torch.Tensor, samples: Seq[Sample]) -> None:
        """Mask (in place) the logits rows of the constrained ``samples`` (row i is ``samples[i]``)."""
        if not self._matchers:
            return
        matchers = self._matchers
        rows = [i for i, seq in enumerate(samples) if seq.seq_id in matchers]
        if not rows:
            return
        if self._bitmask is None:
            self._bitmask = GrammarBitmask(self._vocab_size, self._max_rows)
        self._bitmask.apply(logits, rows, [matchers[samples[i].seq_id][0] for i in rows])

    def accept(self, seq: Sample, token_id: int) -> bool | None:
        """Advance ``seq``'s matcher: None when unconstrained, else whether its grammar has now ended.

        Raises ``ValueError`` naming the field if the grammar refuses the token (the mask allowed
        nothing the sampler could draw, as when ``min_tokens`` suppresses the only way to end).
        """
        entry = self._matchers.get(seq.seq_id)
        if entry is None:
            return None
        matcher = entry[0]
        if not matcher.accept_token(token_id):
            raise ValueError(f"SamplingParams.structured_outputs: token {token_id} does not continue the "
                             "constraint (nothing it allows could be sampled)")
        return matcher.is_terminated()

    def advance(self, samples: Seq[Sample], token_ids: Seq[int | None], errors: dict[str, str],
                finish: Callable[[Sample, str], None], fail: Callable[[Request, str], None]) -> None:
        """A step's output: each constrained sample's matcher takes its token (None: the sample got none); a
        grammar that has ended ends its sample (``finish`` "stop"); a refused token fails its request
        (``fail``, with the message in ``errors``). Requests already in ``errors`` are skipped."""
        for seq, token_id in zip(samples, token_ids):
            if token_id is None or seq.request.request_id in errors:
                continue
            try:
                ended = self.accept(seq, token_id)
            except ValueError as error:
                errors[seq.request.request_id] = str(error)
                fail(seq.request, str(error))
                continue
            if ended and not seq.is_finished:
                finish(seq, "stop")

    def advance_by_runs(self, samples: Seq[Sample], lengths: Seq[int], errors: dict[str, str],
                        finish: Callable[[Sample, str], None], fail: Callable[[Request, str], None]) -> None:
        """A verification step's output: each constrained sample's matcher takes the tokens its verified run
        appended after its first ``lengths`` tokens; a grammar that ends inside the run ends its sample there
        (stop), and the tokens after it are not output. ``errors``, ``finish`` and ``fail`` as for ``advance``."""
        for seq, length in zip(samples, lengths):
            if seq.request.request_id in errors:
                continue
            for end in range(length + 1, len(seq.token_ids) + 1):
                try:
                    ended = self.accept(seq, seq.token_ids[end - 1])
                except ValueError as error:
                    errors[seq.request.request_id] = str(error)
                    fail(seq.request, str(error))
                    break
                if ended is None:
                    break
                if ended:
                    if end < len(seq.token_ids):  # the run went on past the grammar's end: not output
                        del seq.token_ids[end:]
                        seq.finish_reason = "stop" if seq.is_finished else seq.finish_reason
                    if not seq.is_finished:
                        finish(seq, "stop")
                    break

    # ---- speculative decoding: drafts checked against the grammar, verified positions masked ----

    def num_valid_drafts(self, seq: Sample, drafts: Seq[int]) -> int:
        """How many leading ``drafts`` the grammar allows after ``seq``'s tokens (all for an unconstrained one);
        the matcher is left as it was."""
        entry = self._matchers.get(seq.seq_id)
        if entry is None:
            return len(drafts)
        matcher = entry[0]
        valid = 0
        while valid < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[valid]):
            valid += 1
        if valid:
            matcher.rollback(valid)
        return valid

    def mask_positions(self, logits: torch.Tensor, seq: Sample, first_row: int, drafts: Seq[int]) -> None:
        """Mask (in place) rows ``first_row ..`` of ``logits``, the positions ``seq`` verifies, each to what the
        grammar allows after the drafts before it; the matcher is left as it was."""
        entry = self._matchers.get(seq.seq_id)
        if entry is None:
            return
        matcher = entry[0]
        if self._bitmask is None:
            self._bitmask = GrammarBitmask(self._vocab_size, self._max_rows)
        accepted = 0
        for position in range(len(drafts) + 1):
            if matcher.is_terminated():  # the grammar ended at a drafted stop token, where the run is cut
                break
            self._bitmask.apply(logits, [first_row + position], [matcher])
            if position == len(drafts) or not matcher.accept_token(drafts[position]):
                break  # drafts were checked when proposed: a refusal here leaves the rest to be rejected
            accepted += 1
        if accepted:
            matcher.rollback(accepted)

    @staticmethod
    def _new_matcher(grammar: xgr.CompiledGrammar) -> tuple[xgr.GrammarMatcher, xgr.CompiledGrammar]:
        return xgr.GrammarMatcher(grammar), grammar


def _failure_message(error: BaseException) -> str:
    if isinstance(error, GrammarRejected):
        return str(error)
    return f"SamplingParams.structured_outputs could not be compiled: {type(error).__name__}: {error}"
