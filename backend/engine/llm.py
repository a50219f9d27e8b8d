"""Offline, vLLM-shaped entry point: ``LLM(model=...).generate(prompts, params)``."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from pagedllm.core.config import EngineConfig
from pagedllm.engine.engine_stats import EngineStats
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import FinalOutput, RequestOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.core.sampling_params import SamplingParams

Prompt = str | Mapping[str, Any]
Params = SamplingParams | Mapping[str, Any]


class LLM:
    """Runs an engine to completion in the caller's thread.

    Prompts are strings or ``{"prompt_token_ids": [...]}``. ``model=None`` is
    the embedded default model. Keyword arguments are ``EngineConfig`` fields.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_dict({"model": model, **engine_args}))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: Params | Seq[Params] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[FinalOutput]:
        """Complete every prompt; results come back in the prompts' order.

        ``lora_request``: one adapter for every prompt, or one per prompt (``None``: the base model); the engine
        needs ``enable_lora=True``.
        """
        prompt_list, params_list = _pair(prompts, sampling_params)
        lora_list = _lora_per_prompt(lora_request, len(prompt_list))
        request_ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompt_list, params_list, lora_list):
                request_ids.append(self._add(prompt, params, lora))
        except ValueError:
            self._cancel(request_ids)
            raise
        results: dict[str, FinalOutput] = {}
        n_of = {rid: p.n for rid, p in zip(request_ids, params_list)}
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    result = results.get(out.request_id) or results.setdefault(
                        out.request_id, FinalOutput.start(out, n_of[out.request_id])
                    )
                    result.add(out)
                    bar.update(int(out.finished))
        return [results[rid] for rid in request_ids]

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (a no-op at ``tensor_parallel_size=1``)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, prompt: Prompt, sampling_params: Params | None = None) -> Iterator[RequestOutput]:
        """Yield one request's per-step deltas as the engine produces them."""
        (prompt_one,), (params_one,) = _pair([prompt], sampling_params)
        request_id = self._add(prompt_one, params_one)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self._cancel([request_id])

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _cancel(self, request_ids: list[str]) -> None:
        """Abort requests the caller no longer waits for, so their blocks come back."""
        live = [rid for rid in request_ids if self.engine.has_request(rid)]
        for request_id in live:
            self.engine.abort_request(request_id)
        if live:
            self.engine.step()

    def _add(self, prompt: Prompt, params: SamplingParams, lora_request: LoRARequest | None = None) -> str:
        request_id = str(next(self._ids))
        if isinstance(prompt, str):
            self.engine.add_request(request_id, prompt, params, lora_request)
        elif isinstance(prompt, Mapping) and set(prompt) == {"prompt_token_ids"}:
            self.engine.add_request(request_id, list(prompt["prompt_token_ids"]), params, lora_request)
        else:
            raise ValueError('each prompt must be a string or {"prompt_token_ids": [...]}')
        return request_id


def _pair(prompts: Prompt | Seq[Prompt], params: Params | Seq[Params] | None) -> tuple[list[Prompt], list[SamplingParams]]:
    prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
    if not prompt_list:
        raise ValueError("prompts is empty")
    if params is None or isinstance(params, (SamplingParams, Mapping)):
        params_list = [params] * len(prompt_list)
    else:
        params_list = list(params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
    return prompt_list, [_as_params(p) for p in params_list]


def _lora_per_prompt(lora_request: LoRARequest | Seq[LoRARequest | None] | None,
                     num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    lora_list = list(lora_request)
    if len(lora_list) != num_prompts:
        raise ValueError(f"got {len(lora_list)} lora_requests for {num_prompts} prompts")
    return lora_list


def _as_params(params: Params | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    return SamplingParams.from_dict(params)
