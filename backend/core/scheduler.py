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

A prefill chunk's full blocks are published when it is scheduled, not after its step: a
request admitted behind it in the same step that shares the prompt's start adopts them and
computes only the rest, reading them in the same forward (each layer writes the step's keys
and values before any sequence attends). Without this, a burst of requests sharing a prefix
computes that prefix once per request admitted together.

Speculative decoding: a decoding sequence holding proposals (``Sample.spec_token_ids``)
is scheduled its last token plus as many drafted tokens as the budget allows; they take
ordinary KV slots and count against the token budget. Short of blocks, the drafts are
dropped before anyone is preempted. ``update_from_output`` then takes the verified run
(the accepted drafts and the target's token), appends it up to the first stop, and sets
``num_computed_tokens`` to cover only the accepted tokens: the KV written for rejected
drafts is overwritten later, and as blocks are hashed only up to ``num_computed_tokens``,
drafted tokens never enter the prefix cache.

Beam search: the live beams of a request are one unit. They sit side by side in
``running`` (and in ``waiting`` once preempted), are admitted only all together,
compute their last tokens in the same step (chunked prefill stops each beam
short of its last token until all of them can reach it), and are preempted
together; after a preemption the other beams wait for the best one to recompute
their common prefix and share its full blocks, so a recomputed group holds no
more than it did. ``update_from_output`` takes the step's best candidates per group,
lets ``BeamSearch`` pick the survivors, forks them from their parents (block
tables shared, the partial last block copied on write at the next allocate)
and frees the beams no survivor extends at once.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedllm.core.beam_search import (BeamCandidate, BeamSearch, beam_chunks, shared_full_blocks,
                                       survivor_parents)
from pagedllm.core.kv_cache_manager import NO_MATCH, KVCacheManager
from pagedllm.core.request import Request, Sample, SampleStatus
from pagedllm.core.stop_policy import StopPolicy


# Not frozen, like the other records built per sequence per step: a frozen __init__ costs several times more.
@dataclass(slots=True)
class ScheduledSequence:
    seq: Sample
    num_tokens: int  # tokens computed for it this step, drafted ones included
    spec_token_ids: tuple[int, ...] = ()  # drafted tokens verified this step, after the sequence's last token

    @property
    def completes_prefill(self) -> bool:
        """This step reaches the sequence's last token, so its logits get sampled (before the update)."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_tokens == len(seq.token_ids) + len(self.spec_token_ids)


@dataclass(frozen=True, slots=True)
class BeamBatch:
    """A beam group that samples this step: its live beams, best first, and their logits rows."""

    request: Request
    beams: tuple[Sample, ...]
    logit_rows: tuple[int, ...]  # index of each beam's row among the scheduled sequences that complete


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    block_copies: tuple[tuple[int, int], ...]  # copy-on-write (source, destination) before any write
    preempted: tuple[Sample, ...]
    # One sampler row per entry: the scheduled sequences that reach their last token, each
    # followed by the siblings it forks this step (``n > 1``), which read the same logits.
    samples: tuple[Sample, ...] = ()
    # For each sample, the index of its logits row among the scheduled sequences that complete.
    sample_logit_rows: tuple[int, ...] = ()
    forked: tuple[Sample, ...] = ()  # sequences created this step
    # Sequences that finished since the previous step: the worker drops their persistent state.
    finished_seq_ids: tuple[int, ...] = ()
    beams: tuple[BeamBatch, ...] = ()  # beam groups: not in ``samples``, they take candidates instead
    # The index in ``scheduled`` of each sequence that completes its prefill. Logits rows follow them in order:
    # one row each, or 1 + k rows for a sequence verifying k drafted tokens (one per position).
    completing: tuple[int, ...] = ()
    num_drafted: int = 0  # drafted tokens scheduled this step, over all sequences

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        stop_policy: StopPolicy,
        static_batching: bool = False,
        adapter_gate: Callable[[Request, Seq[Sample]], bool] | None = None,
    ) -> None:
        self.kv = kv
        # Multi-LoRA: whether a waiting request's adapter holds (or can be given) a device slot this step, given
        # the running sequences, whose adapters stay put. A request refused here is skipped, not waited on.
        self.adapter_gate = adapter_gate
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop_policy = stop_policy
        # Static batching admits a new batch only once the previous one has fully finished:
        # the baseline that continuous batching is measured against.
        self.static_batching = static_batching
        self.waiting: deque[Sample] = deque()
        self.running: list[Sample] = []
        self.num_preemptions = 0
        self._static_batch_formed = False
        # Slots promised to the siblings that running ``n > 1`` sequences will fork, so
        # forks never push ``running`` past ``max_num_seqs``.
        self._reserved_forks = 0
        self._finished_seq_ids: list[int] = []
        # Slots beyond a speculating sequence's step, for a draft model's K/V of its next guesses (vLLM's name).
        self.num_lookahead_slots = 0

    def add(self, seq: Sample) -> None:
        request = seq.request
        if request.params.use_beam_search and request.beam_search is None:
            params = request.params
            request.beam_search = BeamSearch(
                params.beam_width, params.length_penalty, params.early_stopping,
                self.stop_policy.stop_token_ids(params),
                self.stop_policy.max_new_tokens(params, len(request.prompt_token_ids)),
            )
            request.beams = [seq]
        self.waiting.append(seq)

    def finish(self, seq: Sample, reason: str) -> None:
        """End ``seq`` (stop, length, abort, error) and release its blocks."""
        if seq.is_finished:
            return
        if seq.status is SampleStatus.RUNNING:
            self.running.remove(seq)
            self._reserved_forks -= seq.pending_forks
        else:
            self.waiting.remove(seq)
        seq.status = SampleStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        self._finished_seq_ids.append(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sample] = []

        allocate = self.kv.allocate  # bound once: the loop below runs for every running sequence
        index = 0
        num_drafted = 0
        # Victims are popped from the end, so the sequences still ahead of ``index`` are all running.
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.request.beam_search is not None:
                used, advance = self._schedule_beams(index, budget, scheduled, preempted)
                budget -= used
                index += advance
                continue
            num_tokens = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            drafts: tuple[int, ...] = ()
            if seq.spec_token_ids and seq.num_computed_tokens + num_tokens == len(seq.token_ids):
                drafts = tuple(seq.spec_token_ids[: budget - num_tokens])  # they follow its last token
            lookahead = self.num_lookahead_slots if drafts else 0
            while not allocate(seq, num_tokens + len(drafts) + lookahead):
                if lookahead or drafts:  # speculation never preempts anyone: drop its room first
                    lookahead, drafts = (0, drafts) if lookahead else (0, ())
                    continue
                victims = self._preempt_last()
                preempted.extend(victims)
                if seq in victims:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, num_tokens + len(drafts), drafts))
                budget -= num_tokens + len(drafts)
                num_drafted += len(drafts)
                if num_tokens > 1:  # a prefill chunk: its blocks are matched by requests admitted below
                    self.kv.cache_full_blocks(seq, seq.num_computed_tokens + num_tokens)
            index += 1

        if not self.running:
            self._static_batch_formed = False
        if not preempted and not (self.static_batching and self._static_batch_formed):
            self._admit_waiting(budget, scheduled)
        return self._with_samples(tuple(scheduled), tuple(preempted), num_drafted)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: Seq[int | Seq[int]],
                           beam_candidates: Seq[Seq[BeamCandidate]] = ()) -> list[Sample]:
        """Apply a step's results; returns the sequences that finished at a token-level stop
        (and the last beams of the beam searches that ended).

        ``sampled_token_ids[i]`` is the token drawn for ``out.samples[i]``, or, for a sample that verified
        drafted tokens, a list: the drafts it accepted, then the target's own token. ``beam_candidates[j]``
        are the best candidates of ``out.beams[j]``, best first.
        """
        if len(sampled_token_ids) != len(out.samples):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(out.samples)} samples")
        if len(beam_candidates) != len(out.beams):
            raise ValueError(f"{len(beam_candidates)} candidate lists for {len(out.beams)} beam groups")
        self.kv.step_computed()
        cache_full_blocks = self.kv.cache_full_blocks
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished:  # ended (error) between schedule and update: its blocks are gone
                continue
            # Drafted positions count only once accepted (below).
            seq.num_computed_tokens += item.num_tokens - len(item.spec_token_ids)
            cache_full_blocks(seq)
        finished: list[Sample] = []
        for seq, token_id in zip(out.samples, sampled_token_ids):
            if seq.is_finished:
                continue
            if seq.spec_token_ids:  # proposals for the old last token: stale now
                seq.spec_token_ids = []
            if type(token_id) is not int:
                if self._append_verified(seq, token_id):
                    finished.append(seq)
                continue
            seq.token_ids.append(token_id)
            reason = self.stop_policy.finish_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        places: dict[Sample, tuple[Sample, ...]] = {}
        for batch, candidates in zip(out.beams, beam_candidates):
            finished.extend(self._step_beams(batch, candidates, places))
        if places:
            # Forks take the places of the beams they replace, so every group stays side by side.
            self.running[:] = [placed for seq in self.running for placed in places.get(seq, (seq,))]
        return finished

    def abandon_step(self, out: SchedulerOutput) -> None:
        """``out``'s forward failed: nothing it scheduled was computed. The blocks published ahead of it are
        forgotten, and the sequences admitted in it that adopted one of them (the newest running ones) are
        preempted to recompute; the others stand as they were scheduled, to compute the same tokens again."""
        forgotten = self.kv.forget_uncomputed()
        block_size = self.kv.block_size

        def adopts(seq: Sample) -> bool:
            return any(block in forgotten for block in seq.block_ids[: seq.num_computed_tokens // block_size])

        while forgotten and any(adopts(seq) for seq in self.running):
            self._preempt_last()

    def _append_verified(self, seq: Sample, token_ids: Seq[int]) -> bool:
        """Append a verified run up to its first stop; the KV of its accepted drafts counts as computed.
        Returns whether ``seq`` finished."""
        for token_id in token_ids:
            seq.token_ids.append(token_id)
            reason = self.stop_policy.finish_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                return True
        # Every token but the last was fed at this step: the last sampled one, then the accepted drafts.
        seq.num_computed_tokens = len(seq.token_ids) - 1
        self.kv.cache_full_blocks(seq)
        return False

    def _with_samples(self, scheduled: tuple[ScheduledSequence, ...], preempted: tuple[Sample, ...],
                      num_drafted: int) -> SchedulerOutput:
        """Fork the siblings of requests sampling their first token; list every sampler row."""
        samples: list[Sample] = []
        rows: list[int] = []
        forked: list[Sample] = []
        beam_rows: dict[Request, dict[Sample, int]] = {}
        completing = [index for index, item in enumerate(scheduled) if item.completes_prefill]
        for row, index in enumerate(completing):
            item = scheduled[index]
            parent = item.seq
            if parent.request.beam_search is not None:
                beam_rows.setdefault(parent.request, {})[parent] = row
                continue
            samples.append(parent)
            rows.append(row)
            for _ in range(parent.pending_forks):
                child = parent.request.spawn(list(parent.token_ids))
                self.kv.fork(parent, child)
                # The child shares the blocks this step writes for the parent.
                child.num_computed_tokens = parent.num_computed_tokens + item.num_tokens
                child.status = SampleStatus.RUNNING
                self.running.append(child)
                self._reserved_forks -= 1
                samples.append(child)
                rows.append(row)
                forked.append(child)
        finished, self._finished_seq_ids = tuple(self._finished_seq_ids), []
        beams = tuple(BeamBatch(request, tuple(request.beams), tuple(rows_of[beam] for beam in request.beams))
                      for request, rows_of in beam_rows.items())
        return SchedulerOutput(scheduled=scheduled, block_copies=tuple(self.kv.take_pending_copies()),
                               preempted=preempted, samples=tuple(samples), sample_logit_rows=tuple(rows),
                               forked=tuple(forked), finished_seq_ids=finished, beams=beams,
                               completing=tuple(completing), num_drafted=num_drafted)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSequence]) -> None:
        # A static batch, once formed, admits nobody until all of it has finished; it
        # keeps forming across steps while only the token budget holds it back.
        self._static_batch_formed = True
        skipped: list[Sample] = []  # waiting for an adapter slot: they keep their places in the queue
        while self.waiting:
            if budget == 0:
                self._static_batch_formed = False
                break
            seq = self.waiting[0]
            if self.adapter_gate is not None and not self.adapter_gate(seq.request, self.running):
                while self.waiting and self.waiting[0].request is seq.request:
                    skipped.append(self.waiting.popleft())
                continue
            if seq.request.beam_search is not None:
                used = self._admit_beams(seq.request, budget, scheduled)
                if used is None:
                    break
                budget -= used
                continue
            forks = seq.pending_forks
            if len(self.running) + self._reserved_forks + 1 + forks > self.max_num_seqs:
                break
            match = self.kv.match_prefix(seq) if seq.num_computed_tokens == 0 else NO_MATCH
            num_cached = len(match.blocks) * self.kv.block_size
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate(seq, num_tokens, match):
                break
            self.waiting.popleft()
            seq.status = SampleStatus.RUNNING
            self.running.append(seq)
            self._reserved_forks += forks
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
            # Requests behind it that share its prompt's start match these blocks in this same step.
            self.kv.cache_full_blocks(seq, seq.num_computed_tokens + num_tokens)
        self.waiting.extendleft(reversed(skipped))

    def _schedule_beams(self, index: int, budget: int, scheduled: list[ScheduledSequence],
                        preempted: list[Sample]) -> tuple[int, int]:
        """Schedule the beam group at ``running[index]`` as one unit; returns (tokens used, places to advance)."""
        request = self.running[index].request
        group = self.running[index : index + len(request.beams)]
        ready = [self._join_leader(request, beam) for beam in group]
        chunks = beam_chunks([beam.num_tokens - beam.num_computed_tokens for beam in group], ready, budget)
        if not any(chunks):
            return 0, len(group)
        # A beam whose blocks were allocated before a retry needs nothing more: allocate is idempotent.
        while not all(self.kv.allocate(beam, n) for beam, n in zip(group, chunks) if n):
            victims = self._preempt_last()
            preempted.extend(victims)
            if group[0] in victims:
                return 0, 0
        scheduled.extend(ScheduledSequence(beam, n) for beam, n in zip(group, chunks) if n)
        return sum(chunks), len(group)

    def _admit_beams(self, request: Request, budget: int, scheduled: list[ScheduledSequence]) -> int | None:
        """Admit the beam group at the head of the queue, all of it or nothing; returns the tokens it uses."""
        group = request.beams
        forks = group[0].pending_forks
        if len(self.running) + self._reserved_forks + len(group) + forks > self.max_num_seqs:
            return None
        # Only the leader takes blocks from the prefix cache; the others share the leader's blocks as it
        # computes them (waiting until it has). A beam adopting its own, possibly shorter, cached prefix
        # would recompute the rest alone and could need more blocks than admission allowed, forever.
        leader = group[0]
        matches = [self.kv.match_prefix(leader) if leader.num_computed_tokens == 0 else NO_MATCH]
        matches += [NO_MATCH] * (len(group) - 1)
        cached = [len(match.blocks) * self.kv.block_size for match in matches]
        ready = [self._join_leader(request, beam) for beam in group]
        chunks = beam_chunks(
            [beam.num_tokens - beam.num_computed_tokens - n for beam, n in zip(group, cached)], ready, budget)
        if not any(chunks):
            return None
        # Counting every matched block as if it had to be taken from the free pool keeps this all or nothing.
        needed = sum(self.kv.blocks_needed(beam.num_computed_tokens + c + n) - len(beam.block_ids)
                     for beam, c, n in zip(group, cached, chunks))
        if needed > self.kv.num_free_blocks:
            return None
        for beam, match, n in zip(group, matches, chunks):
            if not self.kv.allocate(beam, n, match):
                raise RuntimeError(f"beam of request {request.request_id} did not fit after the group's check")
        admitted = [self.waiting.popleft() for _ in group]
        if set(admitted) != set(group):
            raise RuntimeError(f"the beams of request {request.request_id} are not together in the queue")
        for beam in admitted:
            beam.status = SampleStatus.RUNNING
        self.running.extend(admitted)
        self._reserved_forks += forks
        scheduled.extend(ScheduledSequence(beam, n) for beam, n in zip(group, chunks) if n)
        return sum(chunks)

    def _join_leader(self, request: Request, beam: Sample) -> bool:
        """After a preemption, ``beam`` (holding no blocks) shares the full blocks its group's best beam
        has computed for their common prefix instead of computing them again. False while the leader
        has not computed that far: ``beam`` waits, so a group never needs more blocks than before."""
        leader = request.beams[0]
        if beam is leader or beam.block_ids or beam.num_computed_tokens:
            return True
        common = shared_full_blocks(beam.token_ids, leader.token_ids, self.kv.block_size)
        if leader.num_computed_tokens < common * self.kv.block_size:
            return False
        self.kv.fork(leader, beam, common)
        return True

    def _step_beams(self, batch: BeamBatch, candidates: Seq[BeamCandidate],
                    places: dict[Sample, tuple[Sample, ...]]) -> list[Sample]:
        """Apply one beam search step; returns the group's beams if the search ended."""
        request = batch.request
        beams = request.beams
        search = request.beam_search
        if search is None or any(beam.is_finished for beam in beams):  # ended (abort, error) since schedule()
            return []
        step = search.step(candidates, lambda i: beams[i].output_token_ids)
        if step.done:
            for beam in beams:
                self.finish(beam, "stop")
            return list(beams)
        continuing, forks = survivor_parents(step.survivors)
        ranked: list[Sample] = [beams[0]] * len(step.survivors)
        for parent, rank in continuing.items():
            ranked[rank] = beams[parent]
        children = []
        for rank in forks:
            parent = beams[step.survivors[rank].beam]
            child = request.spawn(list(parent.token_ids))
            self.kv.fork(parent, child)
            child.status = SampleStatus.RUNNING
            ranked[rank] = child
            children.append(child)
        dead = [beam for index, beam in enumerate(beams) if index not in continuing]
        for beam in dead:
            self._drop_beam(beam)
        for seq, candidate in zip(ranked, step.survivors):
            seq.token_ids.append(candidate.token_id)
            seq.cumulative_logprob = candidate.cumulative_logprob
        if len(beams) == 1:  # the first step: the siblings were reserved at admission and follow their parent
            self._reserved_forks -= len(children)
            places[beams[0]] = (beams[0], *children)
        else:
            places.update((old, (new,)) for old, new in zip(dead, children))
        request.beams = ranked
        return []

    def _drop_beam(self, seq: Sample) -> None:
        """A beam no survivor extends: its blocks go back now; a fork takes its place in ``running``."""
        seq.status = SampleStatus.FINISHED
        self.kv.free(seq)
        self._finished_seq_ids.append(seq.seq_id)

    def _preempt_last(self) -> list[Sample]:
        """Preempt the newest running unit: one sequence, or a whole beam group (its beams end the list)."""
        last = self.running[-1]
        size = len(last.request.beams) if last.request.beam_search is not None else 1
        victims = self.running[-size:]
        if any(victim.request is not last.request for victim in victims):
            raise RuntimeError(f"the beams of request {last.request.request_id} are not together in running")
        del self.running[-size:]
        for victim in reversed(victims):  # pushed to the front one by one: reversed keeps their order
            self._preempt(victim)
        return victims

    def _preempt(self, seq: Sample) -> None:
        self._reserved_forks -= seq.pending_forks
        seq.spec_token_ids = []
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SampleStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
