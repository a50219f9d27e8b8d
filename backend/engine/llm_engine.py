"""The engine: requests in, one scheduled iteration per ``step()``, per-step deltas out.

Single-threaded by design; ``EngineLoop`` runs it on a thread for servers.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from pagedllm.worker.attention_backend import select_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.model_source import resolve_model_dir
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.models import CausalLM, load_model
from pagedllm.engine.outputs import CompletionDelta, RequestOutput
from pagedllm.core.request import Request, Sequence, SequenceStatus
from pagedllm.worker.sampler import SampledToken, Sampler, SamplingRow, make_generator
from pagedllm.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler, SchedulerOutput

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "default_model"
MAX_LOGPROBS = 20
_CPU_KV_BUDGET_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_blocks_total: int
    num_blocks_free: int
    peak_blocks_used: int
    peak_tokens_held: int  # tokens whose K/V sat in the cache when block use peaked
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_running: int
    num_waiting: int
    prompt_tokens_total: int
    generation_tokens_total: int
    block_size: int

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_blocks_free

    @property
    def peak_waste_fraction(self) -> float:
        """Share of the KV slots allocated at peak that held no token."""
        slots = self.peak_blocks_used * self.block_size
        return 0.0 if slots == 0 else 1.0 - self.peak_tokens_held / slots


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model_dir(config.model, config.revision) if config.model is not None else DEFAULT_MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"model={str(model_dir)!r} is not a Hugging Face checkpoint directory (no config.json)")
        self.device = config.torch_device()
        torch.manual_seed(config.seed)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            resolve_model_dir(config.tokenizer, config.revision, field="tokenizer") if config.tokenizer else model_dir)
        attention = select_attention_backend(
            self.device, {"auto": None, "triton": True, "torch": False}[config.attention_backend]
        )
        checkpoint_dtype = _checkpoint_dtype(model_dir)
        self.dtype = config.torch_dtype(checkpoint_dtype)
        self.model: CausalLM = load_model(model_dir, self.dtype, self.device, attention)
        self.max_model_len = _max_model_len(self.model, config.max_model_len)
        self.eos_token_ids = _eos_token_ids(model_dir, self.tokenizer)
        num_blocks = self._num_kv_blocks()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, attention, num_blocks, config.block_size, self.dtype, self.device)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, static_batching=config.scheduling == "static"
        )
        self.sampler = Sampler()
        self._requests: dict[str, Request] = {}
        self._pending_aborts: set[str] = set()
        self._seq_ids = itertools.count()
        self._peak_tokens_held = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams) -> None:
        """Queue a request; raises ``ValueError`` for input it could never serve."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in flight")
        prompt_ids, text = self._tokenize(prompt)
        self._validate(prompt_ids, params)
        request = Request(request_id, text, tuple(prompt_ids), params)
        seq = self._new_sequence(request, 0, list(prompt_ids))
        self._requests[request_id] = request
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
        deltas: dict[str, list[CompletionDelta]] = {}
        self._apply_aborts(deltas)
        if self.scheduler.has_work():
            step = self.scheduler.schedule()
            if step.scheduled:
                self._run(step, deltas)
        return [self._request_output(request_id, items) for request_id, items in deltas.items()]

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
        )

    def _run(self, step: SchedulerOutput, deltas: dict[str, list[CompletionDelta]]) -> None:
        self._track_usage(step)
        logits = self.runner.execute(step)
        sampled = [item.seq for item in step.scheduled if item.completes_prefill]
        for item in step.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.cache_full_blocks(item.seq)
        rows: list[Sequence] = []
        logit_rows: list[int] = []
        for index, seq in enumerate(sampled):
            family = [seq, *self._fork(seq)] if seq.needs_fork else [seq]
            rows.extend(family)
            logit_rows.extend([index] * len(family))
        if len(rows) != len(sampled):
            logits = logits[torch.tensor(logit_rows, device=logits.device)]
        tokens = self.sampler(logits, [self._sampling_row(seq) for seq in rows])
        for seq, token in zip(rows, tokens):
            deltas.setdefault(seq.request.request_id, []).append(self._append(seq, token))

    def _append(self, seq: Sequence, token: SampledToken) -> CompletionDelta:
        params = seq.request.params
        if seq.num_output_tokens == 0 and seq.index == 0:
            self._prompt_tokens_total += seq.num_prompt_tokens
        self._generation_tokens_total += 1
        seq.token_ids.append(token.token_id)
        seq.cumulative_logprob += token.logprob
        stop_token = self._is_stop_token(seq, token.token_id)
        # As in vLLM, the EOS / stop token that ends a sample is not part of its text.
        if stop_token and not params.include_stop_str_in_output:
            text, stop_string = "", None
        else:
            update = seq.detokenizer.update([token.token_id])
            text, stop_string = update.text, update.stop_string
        reason = "stop" if stop_token or stop_string is not None else self._length_reason(seq)
        if reason is not None:
            if stop_string is None:
                text += seq.detokenizer.flush()
            self._finish(seq, reason)
        logprobs = (token.top_logprobs or {token.token_id: token.logprob},) if params.logprobs is not None else None
        return CompletionDelta(seq.index, text, (token.token_id,), seq.cumulative_logprob, logprobs, reason)

    def _is_stop_token(self, seq: Sequence, token_id: int) -> bool:
        params = seq.request.params
        if seq.num_output_tokens < params.min_tokens:
            return False
        return token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos)

    def _length_reason(self, seq: Sequence) -> str | None:
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None and seq.num_output_tokens >= max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)

    def _apply_aborts(self, deltas: dict[str, list[CompletionDelta]]) -> None:
        for request_id in self._pending_aborts:
            request = self._requests.get(request_id)
            if request is None:
                continue
            live = {seq.index: seq for seq in request.sequences if not seq.is_finished}
            for index in range(request.params.n):
                seq = live.get(index)
                if seq is None and index < len(request.sequences):
                    continue
                text = ""
                logprob = 0.0
                if seq is not None:
                    text = seq.detokenizer.flush()
                    logprob = seq.cumulative_logprob
                    self._finish(seq, "abort")
                deltas.setdefault(request_id, []).append(CompletionDelta(index, text, (), logprob, None, "abort"))
        self._pending_aborts.clear()

    def _request_output(self, request_id: str, items: list[CompletionDelta]) -> RequestOutput:
        request = self._requests[request_id]
        finished = request.is_finished or any(d.finish_reason == "abort" for d in items)
        if finished:
            del self._requests[request_id]
        return RequestOutput(request_id, request.prompt, request.prompt_token_ids, tuple(items), finished)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        request = parent.request
        children = []
        for index in range(len(request.sequences), request.params.n):
            child = self._new_sequence(request, index, list(parent.token_ids))
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params),
            generator=make_generator(request.params.seed, index, self.device),
        )
        request.sequences.append(seq)
        return seq

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.request.params
        suppressed: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            suppressed = (*eos, *params.stop_token_ids)
        return SamplingRow(params, seq.generator, seq.prompt_token_ids, seq.output_token_ids, suppressed)

    def _track_usage(self, step: SchedulerOutput) -> None:
        if self.kv.num_used_blocks < self.kv.peak_blocks_used:
            return
        held = sum(seq.num_computed_tokens for seq in self.scheduler.running)
        self._peak_tokens_held = held + step.num_tokens

    def _tokenize(self, prompt: str | Seq[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer.encode(prompt)), prompt
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        vocab = self.model.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return ids, None

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("prompt is empty after tokenization")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}: "
                "there is no room for a single output token"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} is too large: the prompt has {len(prompt_ids)} tokens "
                f"and max_model_len is {self.max_model_len}, so at most {room} can be generated"
            )
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs={params.logprobs} is invalid: at most {MAX_LOGPROBS}")
        longest = len(prompt_ids) + (params.max_tokens if params.max_tokens is not None else room)
        if self.kv.blocks_needed(longest) > self.kv.num_blocks:
            raise ValueError(
                f"request can never fit in the KV cache: {longest} tokens need "
                f"{self.kv.blocks_needed(longest)} blocks of {self.kv.block_size}, "
                f"the cache has {self.kv.num_blocks} (raise num_kv_blocks or lower max_tokens)"
            )

    def _num_kv_blocks(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = ModelRunner.bytes_per_block(self.model, config.block_size, self.dtype)
        # Never reserve more than every sequence at full length could ever use.
        enough = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        if config.kv_cache_memory_gb is not None:
            budget = int(config.kv_cache_memory_gb * (1 << 30))
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1 - config.gpu_memory_utilization) * total)
        else:
            budget = _CPU_KV_BUDGET_BYTES
        blocks = min(budget // per_block, enough)
        if blocks < 1:
            raise ValueError(f"no memory left for the KV cache ({budget} bytes for {per_block}-byte blocks)")
        return blocks


def _checkpoint_dtype(model_dir: Path) -> torch.dtype | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        return getattr(torch, dtype, None)
    return dtype


def _max_model_len(model: CausalLM, requested: int | None) -> int:
    limit = getattr(model.config, "max_position_embeddings", None)
    # Sliding-window attention is not implemented: contexts stay within the window.
    if model.sliding_window is not None:
        limit = model.sliding_window if limit is None else min(limit, model.sliding_window)
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings: set max_model_len")
        return int(limit)
    if limit is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} is larger than the model's max_position_embeddings={limit}")
    return requested


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
