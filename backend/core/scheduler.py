"""Iteration-level scheduler: which sequences compute how many tokens this step.

FCFS. Running sequences are served first, then waiting ones while the token
budget, ``max_num_seqs`` and the free KV blocks last. A sequence is simply
given ``min(tokens it has not computed, budget left)`` tokens, so prefills are
chunked for free and decodes ride along with them. Out of blocks, the newest
running sequence is preempted by recompute: its blocks are freed and it goes
back to the front of the queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedllm.core.kv_cache_manager import NO_MATCH, KVCacheManager
from pagedllm.core.request import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step

    @property
    def completes_prefill(self) -> bool:
        """This step reaches the sequence's last token, so its logits get sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    block_copies: tuple[tuple[int, int], ...]  # copy-on-write (source, destination) before any write
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        static_batching: bool = False,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Static batching admits a new batch only once the previous one has fully finished:
        # the baseline that continuous batching is measured against.
        self.static_batching = static_batching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._static_batch_formed = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling: it already shares its parent's computed blocks."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

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
            budget = self._admit_waiting(budget, scheduled)

        return SchedulerOutput(tuple(scheduled), tuple(self.kv.take_pending_copies()), tuple(preempted))

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSequence]) -> int:
        # A static batch, once formed, admits nobody until all of it has finished; it
        # keeps forming across steps while only the token budget holds it back.
        self._static_batch_formed = True
        while self.waiting:
            if budget == 0:
                self._static_batch_formed = False
                break
            seq = self.waiting[0]
            slots = seq.request.params.n if seq.needs_fork else 1
            if len(self.running) + slots > self.max_num_seqs:
                break
            match = self.kv.match_prefix(seq) if seq.num_computed_tokens == 0 else NO_MATCH
            num_cached = len(match.blocks) * self.kv.block_size
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate(seq, num_tokens, match):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
