"""Iteration-level scheduler: which sequences compute how many tokens this step, and what a step changed.

FCFS. Running sequences are served first, then waiting ones while the token
budget, ``max_num_seqs`` and the free KV blocks last. A sequence is simply
given ``min(tokens it has not computed, budget left)`` tokens, so prefills are
chunked for free and decodes ride along with them. Out of blocks, the newest
running sequence is preempted by recompute: its blocks are freed and it goes
back to the front of the queue.

``update_from_output`` is the one place a step's results are applied (the
engine, the null-model engine and the property tests all call it): computed
tokens advance, full blocks are published to the prefix cache, sampled tokens
are appended, token-level stops are checked and finished sequences freed.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedllm.core.kv_cache_manager import NO_MATCH, KVCacheManager
from pagedllm.core.request import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step

    @property
    def completes_prefill(self) -> bool:
        """This step reaches the sequence's last token, so its logits get sampled (before the update)."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    block_copies: tuple[tuple[int, int], ...]  # copy-on-write (source, destination) before any write
    preempted: tuple[Sequence, ...]
    # One sampler row per entry: the scheduled sequences that reach their last token, each
    # followed by the siblings it forks this step (``n > 1``), which read the same logits.
    samples: tuple[Sequence, ...] = ()
    # For each sample, the index of its logits row among the scheduled sequences that complete.
    sample_logit_rows: tuple[int, ...] = ()
    forked: tuple[Sequence, ...] = ()  # sequences created this step
    # Sequences that finished since the previous step: the worker drops their persistent state.
    finished_seq_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(frozen=True, slots=True)
class StopPolicy:
    """Token-level stops; stop strings are text and are checked by the engine's output processing."""

    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()

    def finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        """Why ``seq`` ends now that ``token_id`` was appended to it, if it does."""
        params = seq.request.params
        if seq.num_output_tokens >= params.min_tokens and (
            token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos)
        ):
            return "stop"
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        stop_policy: StopPolicy,
        static_batching: bool = False,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop_policy = stop_policy
        # Static batching admits a new batch only once the previous one has fully finished:
        # the baseline that continuous batching is measured against.
        self.static_batching = static_batching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._static_batch_formed = False
        # Slots promised to the siblings that running ``n > 1`` sequences will fork, so
        # forks never push ``running`` past ``max_num_seqs``.
        self._reserved_forks = 0
        self._finished_seq_ids: list[int] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (stop, length, abort, error) and release its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._reserved_forks -= seq.pending_forks
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        self._finished_seq_ids.append(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []

        index = 0
        # Victims are popped from the end, so the sequences still ahead of ``index`` are all running.
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, num_tokens))
                budget -= num_tokens
            index += 1

        if not self.running:
            self._static_batch_formed = False
        if not preempted and not (self.static_batching and self._static_batch_formed):
            self._admit_waiting(budget, scheduled)
        return self._with_samples(tuple(scheduled), tuple(preempted))

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: Seq[int]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that finished at a token-level stop.

        ``sampled_token_ids[i]`` is the token drawn for ``out.samples[i]``.
        """
        if len(sampled_token_ids) != len(out.samples):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(out.samples)} samples")
        for item in out.scheduled:
            if item.seq.is_finished:  # ended (error) between schedule and update: its blocks are gone
                continue
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.cache_full_blocks(item.seq)
        finished: list[Sequence] = []
        for seq, token_id in zip(out.samples, sampled_token_ids):
            if seq.is_finished:
                continue
            seq.token_ids.append(token_id)
            reason = self.stop_policy.finish_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _with_samples(self, scheduled: tuple[ScheduledSequence, ...], preempted: tuple[Sequence, ...]) -> SchedulerOutput:
        """Fork the siblings of requests sampling their first token; list every sampler row."""
        samples: list[Sequence] = []
        rows: list[int] = []
        forked: list[Sequence] = []
        completing = [item for item in scheduled if item.completes_prefill]
        for row, item in enumerate(completing):
            parent = item.seq
            samples.append(parent)
            rows.append(row)
            for _ in range(parent.pending_forks):
                child = parent.request.spawn(list(parent.token_ids))
                self.kv.fork(parent, child)
                # The child shares the blocks this step writes for the parent.
                child.num_computed_tokens = parent.num_computed_tokens + item.num_tokens
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                self._reserved_forks -= 1
                samples.append(child)
                rows.append(row)
                forked.append(child)
        finished, self._finished_seq_ids = tuple(self._finished_seq_ids), []
        return SchedulerOutput(scheduled, tuple(self.kv.take_pending_copies()), preempted,
                               tuple(samples), tuple(rows), tuple(forked), finished)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSequence]) -> None:
        # A static batch, once formed, admits nobody until all of it has finished; it
        # keeps forming across steps while only the token budget holds it back.
        self._static_batch_formed = True
        while self.waiting:
            if budget == 0:
                self._static_batch_formed = False
                break
            seq = self.waiting[0]
            forks = seq.pending_forks
            if len(self.running) + self._reserved_forks + 1 + forks > self.max_num_seqs:
                break
            match = self.kv.match_prefix(seq) if seq.num_computed_tokens == 0 else NO_MATCH
            num_cached = len(match.blocks) * self.kv.block_size
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate(seq, num_tokens, match):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._reserved_forks += forks
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self._reserved_forks -= seq.pending_forks
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
