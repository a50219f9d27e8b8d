"""The engine: requests in, one scheduled iteration per ``step()``, per-step deltas out.

Single-threaded by design; ``EngineLoop`` runs it on a thread for servers.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from pagedllm.core.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import AllBlocksCleared
from pagedllm.core.request import Request, Sample, SampleStatus
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.stop_policy import StopPolicy
from pagedllm.engine.aborts import abort_request
from pagedllm.engine.admission import AdmissionLimits, check_request, tokenize_prompt
from pagedllm.engine.beam_outputs import beam_search_of, beam_step_candidates, finished_beam_outputs
from pagedllm.engine.engine_stats import EngineStats, adapters_of
from pagedllm.executor.device_side import engine_device, set_up_device_side
from pagedllm.platform.gc_tuning import collect_young_less_often
from pagedllm.engine.kv_event_publisher import KVEventPublisher
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import CompletionDelta, RequestOutput
from pagedllm.engine.structured_outputs import StructuredOutputs
from pagedllm.engine.prompt_logprobs import PromptLogprobsCollector
from pagedllm.engine.speculative import SpeculativeDecoding
from pagedllm.lora.request import LoRARequest
from pagedllm.core.model_source import DEFAULT_MODEL_DIR, resolve_model_dir
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.platform.cpu_memory import keep_freed_memory
from pagedllm.worker.draft_proposer import DraftProposer
from pagedllm.worker.sampler import (PenaltyState, SampledToken, Sampler, SamplingRow, make_generator,
                                     needs_penalties)

log = logging.getLogger(__name__)

# How long a step with nothing to schedule waits for a grammar still compiling before it returns.
_IDLE_COMPILE_WAIT_S = 0.05


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model_dir(config.model, config.revision) if config.model is not None else DEFAULT_MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"model={str(model_dir)!r} is not a Hugging Face checkpoint directory (no config.json)")
        self.device = engine_device(config)
        if self.device.type == "cpu":
            keep_freed_memory()
        torch.manual_seed(config.seed)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            resolve_model_dir(config.tokenizer, config.revision, field="tokenizer") if config.tokenizer else model_dir)
        side = set_up_device_side(config, model_dir)
        self.dtype, self.model, self.runner = side.dtype, side.model, side.runner
        self.kv_cache_dtype, self.max_model_len, self.lora = side.kv_cache_dtype, side.max_model_len, side.lora
        # Rank 0 of a tensor-parallel group is this engine; the other ranks only run forwards (pagedllm.parallel).
        self.workers = side.workers
        num_blocks = side.num_blocks
        self.eos_token_ids = _eos_token_ids(model_dir, self.tokenizer)
        kv_events = config.kv_events
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 enable_kv_cache_events=kv_events.publishes)
        # Only this engine (rank 0 of a tensor-parallel group) holds the KV cache manager, so only it publishes.
        self.kv_events: KVEventPublisher | None = KVEventPublisher(kv_events) if kv_events.publishes else None
        self._kv_events_lost = False
        if self.kv_events is not None:
            self.kv_events.publish([AllBlocksCleared()])  # whatever an earlier incarnation held is gone
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens,
            StopPolicy(self.max_model_len, self.eos_token_ids), static_batching=config.scheduling == "static",
            adapter_gate=None if self.lora is None else self.lora.admit,
        )
        self.limits = AdmissionLimits(self.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
                                      self.model.vocab_size, num_blocks, config.block_size)
        self.sampler = Sampler()
        self.structured = StructuredOutputs(self.tokenizer, self.model.vocab_size, self.eos_token_ids,
                                            config.structured_outputs_compile_timeout_s, config.max_num_seqs)
        self.speculative = (None if config.speculative_config is None else SpeculativeDecoding(
            config.speculative_config, self.scheduler.stop_policy, self.structured,
            None if side.draft_runner is None else DraftProposer(
                side.draft_runner, config.speculative_config.num_speculative_tokens, config.max_num_batched_tokens,
                config.speculative_config.confidence_threshold, side.draft_vocab)))
        if side.draft_runner is not None and config.speculative_config is not None:
            # The draft writes K/V for its guesses after a sequence's last token: room for them comes with the step.
            self.scheduler.num_lookahead_slots = config.speculative_config.num_speculative_tokens
        self.outputs = OutputProcessor(self.tokenizer)
        self.prompt_logprobs = PromptLogprobsCollector()
        self._requests: dict[str, Request] = {}
        # Each live sample's sampler row, built once: it changes only while min_tokens holds back its stops.
        self._rows: dict[int, SamplingRow] = {}
        self._pending_aborts: set[str] = set()
        # Requests failed for their own input after they were accepted (a constraint that does not compile).
        self._invalid_requests: set[str] = set()
        self._peak_tokens_held = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        collect_young_less_often()

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (through ``lora_request``'s adapter, if given); raises ``ValueError`` for input it could
        never serve, a bad adapter included."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in flight")
        prompt_ids, text = tokenize_prompt(self.tokenizer, prompt, self.model.vocab_size)
        check_request(prompt_ids, params, self.limits)
        if self.speculative is not None:
            self.speculative.check_request(params)
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"lora_request={lora_request.lora_name!r} needs an engine with enable_lora=true")
            self.lora.add(lora_request)
        if params.prompt_logprobs is not None:
            if self.model.tp.size > 1:  # the extra logits would be a collective only rank 0 joins
                raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1")
            self.prompt_logprobs.track(request_id, tuple(prompt_ids), params.prompt_logprobs)
        request = Request(request_id, text, tuple(prompt_ids), params,
                          lora_int_id=0 if lora_request is None else lora_request.lora_int_id,
                          lora_name=None if lora_request is None else lora_request.lora_name)
        seq = request.spawn(list(prompt_ids))
        self._requests[request_id] = request
        if params.structured_outputs is not None:  # scheduled once its grammar has compiled, off the step path
            self.structured.hold(seq)
            return
        if not params.use_beam_search:  # beams have no per-step text: their hypotheses are decoded at the end
            self._track_sequence(seq)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Cancel at the next step, which frees its blocks and reports finish_reason "abort"."""
        if request_id in self._requests:
            self._pending_aborts.add(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """One iteration. Faults that one request causes end that request alone (``RequestOutput.error``);
        a fault that cannot be attributed (the forward of the whole batch) raises."""
        deltas: dict[str, list[CompletionDelta]] = {}
        errors: dict[str, str] = {}
        aborted = self._apply_aborts(deltas)
        if self.structured.num_held:
            if not self.scheduler.has_work():  # nothing else to run: wait a little for a grammar
                self.structured.wait(_IDLE_COMPILE_WAIT_S)
            self._admit_compiled(errors)
        if self.scheduler.has_work():
            out = self.scheduler.schedule()
            self.structured.release(out.finished_seq_ids)
            if self.speculative is not None:
                self.speculative.release(out.finished_seq_ids, [seq.seq_id for seq in out.preempted])
            for child in out.forked:
                self._track_sequence(child)
            if out.scheduled:
                self._run(out, deltas, errors)
        for request_id in errors:
            deltas.setdefault(request_id, [])
        if self.kv_events is not None:
            self._publish_kv_events()
        return [self._request_output(request_id, items, errors.get(request_id), request_id in aborted)
                for request_id, items in deltas.items()]

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and the KV event publisher; the engine cannot step afterwards."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.workers is not None:
            workers, self.workers = self.workers, None
            workers.close()

    def _publish_kv_events(self) -> None:
        """Hand this step's KV cache events to the publisher; after a batch was lost, the whole cache instead."""
        events = self.kv.take_events()
        if self._kv_events_lost:
            events = self.kv.snapshot_events()
        if events:
            self._kv_events_lost = not self.kv_events.publish(events)  # type: ignore[union-attr]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_blocks_total=self.kv.num_blocks,
            num_blocks_free=self.kv.num_free_blocks,
            peak_blocks_used=self.kv.peak_blocks_used,
            peak_tokens_held=self._peak_tokens_held,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=self.kv.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv.prefix_hit_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            block_size=self.kv.block_size,
            spec_decode=None if self.speculative is None else self.speculative.snapshot(),
            enable_prefix_caching=self.kv.enable_prefix_caching,
            max_loras=0 if self.lora is None else self.config.max_loras,
            running_lora_adapters=() if self.lora is None else adapters_of(self.scheduler.running),
            waiting_lora_adapters=() if self.lora is None else adapters_of(self.scheduler.waiting),
        )

    def _run(self, out: SchedulerOutput, deltas: dict[str, list[CompletionDelta]], errors: dict[str, str]) -> None:
        self._track_usage(out)
        try:
            logits = self.runner.execute(out)
        except Exception as error:
            self.scheduler.abandon_step(out)  # nothing of it was computed
            if self.workers is not None:
                self.workers.check(error)
            raise
        if self.prompt_logprobs.wanted():
            self.prompt_logprobs.collect(out, self.runner.last_hidden, self.model.compute_logits)
        if out.num_drafted:
            self._verify(out, logits, deltas, errors)
        else:
            self._sample_step(out, logits, deltas, errors)
        if self.speculative is not None:
            self.speculative.propose(out, len(self.scheduler.running), self._generator_of)

    def _sample_step(self, out: SchedulerOutput, logits: torch.Tensor, deltas: dict[str, list[CompletionDelta]],
                     errors: dict[str, str]) -> None:
        candidates = [beam_step_candidates(logits, batch) for batch in out.beams]
        if out.beams or len(out.samples) != logits.shape[0]:
            logits = logits[torch.tensor(out.sample_logit_rows, device=logits.device, dtype=torch.long)]
        self.structured.mask(logits, out.samples)
        tokens = self._sample(logits, out.samples, errors)
        for seq, token in zip(out.samples, tokens):
            if token is None:
                self._fail(seq.request, errors[seq.request.request_id])
        self.scheduler.update_from_output(out, [0 if token is None else token.token_id for token in tokens],
                                          candidates)
        if self.structured.has_matchers:
            self.structured.advance(out.samples, [None if token is None else token.token_id for token in tokens],
                                    errors, self.scheduler.finish, self._fail)
        self._emit_all(out.samples, tokens, deltas, errors)
        for batch in out.beams:
            self._generation_tokens_total += len(batch.beams)
            search = beam_search_of(batch.request)
            if search.num_output_tokens == 1:  # its first step: the prompt is computed (counted if cancelled later)
                self._prompt_tokens_total += len(batch.request.prompt_token_ids)
            request_id = batch.request.request_id
            if not search.done or request_id in errors:
                continue
            try:
                deltas[request_id] = finished_beam_outputs(self.outputs, batch.request, search)
            except Exception as error:  # decoding a hypothesis failed: this request's fault alone
                log.exception("output processing failed for request %s", request_id)
                errors[request_id] = f"output processing failed: {error}"

    def _verify(self, out: SchedulerOutput, logits: torch.Tensor, deltas: dict[str, list[CompletionDelta]],
                errors: dict[str, str]) -> None:
        """A step holding drafted tokens (pagedllm.engine.speculative): each sample's verified run applied and
        emitted as one delta. Beams never get here."""
        if self.speculative is None:
            raise RuntimeError("a step holds drafted tokens but speculative decoding is off")
        runs = self.speculative.verify(out, logits, self._sampling_row, self._sample, errors)
        for seq, run in zip(out.samples, runs):
            if run is None:
                self._fail(seq.request, errors[seq.request.request_id])
        lengths = [len(seq.token_ids) for seq in out.samples]
        self.scheduler.update_from_output(out, [
            0 if run is None else run[0].token_id if len(run) == 1 else [token.token_id for token in run]
            for run in runs])
        if self.structured.has_matchers:
            self.structured.advance_by_runs(out.samples, lengths, errors, self.scheduler.finish, self._fail)
        self._emit_runs(out.samples, runs, lengths, deltas, errors)

    def _emit_runs(self, samples: Seq[Sample], runs: Seq[list[SampledToken] | None], lengths: Seq[int],
                   deltas: dict[str, list[CompletionDelta]], errors: dict[str, str]) -> None:
        """Output processing of a verification step: each sample's tokens, up to where it stopped, as one delta."""
        for seq, run, length in zip(samples, runs, lengths):
            request_id = seq.request.request_id
            if run is None or request_id in errors:
                continue
            appended = run[: len(seq.token_ids) - length]  # the scheduler cut the run at a token-level stop
            merged: CompletionDelta | None = None
            try:
                for position, token in enumerate(appended):
                    delta = self._emit_token(seq, token, length + position + 1, position == len(appended) - 1)
                    merged = delta if merged is None else _joined(merged, delta)
                    if delta.finish_reason == "stop" and len(seq.token_ids) > length + position + 1:
                        del seq.token_ids[length + position + 1 :]  # a stop string: the rest is not output
                        break
            except Exception as error:  # a detokenizer or stop-string fault is this request's alone
                log.exception("output processing failed for request %s", request_id)
                errors[request_id] = f"output processing failed: {error}"
                self._fail(seq.request, errors[request_id])
                continue
            self._generation_tokens_total += len(merged.token_ids) if merged is not None else 0
            if merged is not None:
                deltas.setdefault(request_id, []).append(merged)

    def _emit_all(self, samples: Seq[Sample], tokens: Seq[SampledToken | None],
                  deltas: dict[str, list[CompletionDelta]], errors: dict[str, str]) -> None:
        """Output processing of a step: each sample's text delta, stop strings."""
        emit = self._emit_token
        emitted = 0
        for seq, token in zip(samples, tokens):
            request_id = seq.request.request_id
            if token is None or request_id in errors:
                continue
            emitted += 1
            try:
                delta = emit(seq, token, len(seq.token_ids), True)
            except Exception as error:  # a detokenizer or stop-string fault is this request's alone
                log.exception("output processing failed for request %s", request_id)
                errors[request_id] = f"output processing failed: {error}"
                self._fail(seq.request, errors[request_id])
                continue
            request_deltas = deltas.get(request_id)
            if request_deltas is None:
                deltas[request_id] = [delta]
            else:
                request_deltas.append(delta)
        self._generation_tokens_total += emitted

    def _emit_token(self, seq: Sample, token: SampledToken, length: int, last: bool) -> CompletionDelta:
        """One appended token's output processing: ``length`` is ``seq``'s token count with it; ``last``: the
        last token of its step's run (the detokenizer checks stop strings then). A stop string, which only
        the text shows, finishes ``seq`` here."""
        if length == seq.num_prompt_tokens + 1 and seq.index == 0:  # its first token
            self._prompt_tokens_total += seq.num_prompt_tokens
        if token.logprob is not None:
            seq.cumulative_logprob += token.logprob
        penalties = self._rows[seq.seq_id].penalties
        if penalties is not None:
            penalties.append(token.token_id)
        delta = self.outputs.process(seq, token, last=last)
        if delta.finish_reason == "stop" and seq.finish_reason != "stop":
            if seq.is_finished:
                seq.finish_reason = "stop"
            else:
                self.scheduler.finish(seq, "stop")
        if seq.is_finished and (last or delta.finish_reason is not None):  # nothing of its run follows
            self._rows.pop(seq.seq_id, None)
        return delta

    def _sample(self, logits: torch.Tensor, samples: Seq[Sample], errors: dict[str, str],
                rows: Seq[SamplingRow] | None = None) -> list[SampledToken | None]:
        """One token per sample (per row of ``rows``, owned by ``samples``, when given); a row whose parameters
        make the sampler fail gets None (and an error)."""
        if rows is None:
            rows = [self._sampling_row(seq) for seq in samples]
        try:
            return list(self.sampler(logits, rows))
        except Exception:
            log.exception("batched sampling failed; retrying row by row to find the faulty request")
        tokens: list[SampledToken | None] = []
        for index, (seq, row) in enumerate(zip(samples, rows)):
            try:
                (token,) = self.sampler(logits[index : index + 1], [row])
                tokens.append(token)
            except Exception as error:
                errors[seq.request.request_id] = f"sampling failed: {error}"
                tokens.append(None)
        return tokens

    def _admit_compiled(self, errors: dict[str, str]) -> None:
        """Schedule the held requests whose grammar compiled; fail those whose grammar cannot be had."""
        ready, failed = self.structured.take_compiled()
        for seq in ready:
            self._track_sequence(seq)
            self.scheduler.add(seq)
        for failure in failed:
            failure.seq.status = SampleStatus.FINISHED  # it never reached the scheduler: nothing to free
            failure.seq.finish_reason = "error"
            errors[failure.seq.request.request_id] = failure.message
            self._invalid_requests.add(failure.seq.request.request_id)

    def _fail(self, request: Request, message: str) -> None:
        """End every sample of ``request`` because it faulted; the rest of the batch carries on."""
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
            self._release(seq)

    def _release(self, seq: Sample) -> str:
        self._rows.pop(seq.seq_id, None)
        return self.outputs.close(seq)

    def _apply_aborts(self, deltas: dict[str, list[CompletionDelta]]) -> set[str]:
        """End the requests aborted since the previous step; returns their ids."""
        aborted: set[str] = set()
        for request_id in self._pending_aborts:
            request = self._requests.get(request_id)
            if request is None:
                continue
            aborted.add(request_id)
            items = abort_request(request, self.structured.drop(request_id), self.scheduler.finish, self._release)
            if items:
                deltas[request_id] = items
        self._pending_aborts.clear()
        return aborted

    def _request_output(self, request_id: str, items: list[CompletionDelta], error: str | None,
                        aborted: bool) -> RequestOutput:
        request = self._requests[request_id]
        finished = aborted or error is not None or request.is_finished
        prompt_logprobs = self.prompt_logprobs.take(request_id)
        invalid_input = request_id in self._invalid_requests
        if finished:
            del self._requests[request_id]
            self.prompt_logprobs.discard(request_id)
            self._invalid_requests.discard(request_id)
        return RequestOutput(request_id=request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
                             outputs=tuple(items), finished=finished, error=error, prompt_logprobs=prompt_logprobs,
                             invalid_input=invalid_input)

    def _track_sequence(self, seq: Sample) -> None:
        params = seq.request.params
        penalties = PenaltyState(seq.prompt_token_ids, seq.output_token_ids) if needs_penalties(params) else None
        self._rows[seq.seq_id] = SamplingRow(params, make_generator(params.seed, seq.index, self.device), penalties, ())
        self.outputs.add(seq)
        if params.structured_outputs is not None:
            self.structured.track(seq)

    def _generator_of(self, seq: Sample) -> torch.Generator | None:
        return self._rows[seq.seq_id].generator

    def _sampling_row(self, seq: Sample) -> SamplingRow:
        row = self._rows[seq.seq_id]
        params = row.params
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            return SamplingRow(params, row.generator, row.penalties, (*eos, *params.stop_token_ids))
        return row

    def _track_usage(self, out: SchedulerOutput) -> None:
        if self.kv.num_used_blocks < self.kv.peak_blocks_used:
            return
        held = sum(seq.num_computed_tokens for seq in self.scheduler.running)
        self._peak_tokens_held = held + out.num_tokens


def _joined(first: CompletionDelta, then: CompletionDelta) -> CompletionDelta:
    """One delta for two consecutive ones of the same sample."""
    logprobs = None if first.logprobs is None or then.logprobs is None else first.logprobs + then.logprobs
    return CompletionDelta(first.index, first.text + then.text, first.token_ids + then.token_ids,
                           then.cumulative_logprob, logprobs, then.finish_reason)


def _eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(value)
    return frozenset(ids)
