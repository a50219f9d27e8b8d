"""What routers ask a replica besides completions: load, model and server info, metrics, rendered prompts.

vllm-router (and SGLang's router, whose worker contract it keeps) probes each worker at the
URL it routes to: ``GET /health`` and ``/v1/models`` (in ``app.py``), ``GET /get_load``
(SGLang's per-rank list ``dp_rank, num_reqs, num_waiting_reqs, num_tokens``, which
``power_of_two`` and the load-aware policies read), ``GET /get_model_info`` and
``/get_server_info``, and, for ``kv_aware`` and llm-d's precise prefix scorer,
``POST /v1/completions/render`` and ``/v1/chat/completions/render``: the token ids the engine
will see for that body (a list of one ``GenerateRequest``-shaped object for completions, one
object for chat, as vLLM's render endpoints answer). ``GET /load`` is vLLM's
(``server_load``: requests in the engine). ``GET /metrics`` passes Triton's metrics endpoint
through, so one URL per replica serves routers and scrapers alike, as vLLM's API port does.

The load figures are the engine's own gauges (``vllm:num_requests_*``, ``pagedllm:kv_blocks_used``
and ``vllm:cache_config_info``), read from Triton's metrics endpoint: one source of truth.
"""
from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.serving.openai.errors import OpenAIError, bad_request
from pagedllm.serving.openai.ignored_fields import note_ignored_fields
from pagedllm.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.serving.openai.served_models import ServedModel

METRICS_TIMEOUT_S = 5.0
_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: \d+)?')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engines' load, summed over the Triton models this door serves."""

    running: int
    waiting: int
    kv_tokens: int  # tokens' worth of KV blocks referenced by requests
    block_size: int | None


def engine_load(metrics_text: str, triton_models: set[str]) -> EngineLoad:
    running = waiting = used_blocks = 0
    block_size: int | None = None
    for line in metrics_text.splitlines():
        if not line.startswith(("vllm:", "pagedllm:")):
            continue
        match = _SAMPLE.fullmatch(line)
        if match is None:
            continue
        name, labels = match.group(1), dict(_LABEL.findall(match.group(2) or ""))
        if labels.get("model") not in triton_models:
            continue
        value = float(match.group(3))
        if name == "vllm:num_requests_running":
            running += int(value)
        elif name == "vllm:num_requests_waiting":
            waiting += int(value)
        elif name == "pagedllm:kv_blocks_used":
            used_blocks += int(value)
        elif name == "vllm:cache_config_info" and "block_size" in labels:
            block_size = int(labels["block_size"])
    return EngineLoad(running, waiting, used_blocks * (block_size or 0), block_size)


def add_router_routes(app: FastAPI, by_name: Mapping[str, ServedModel],
                      metrics_url: Callable[[], str | None]) -> None:
    """``metrics_url``: Triton's metrics endpoint (``host:port``), or None where there is none."""
    triton_models = {model.triton_model for model in by_name.values()}
    first = next(iter(by_name.values()))

    async def metrics_text() -> str:
        url = metrics_url()
        if url is None:
            raise OpenAIError(503, "this server has no Triton metrics endpoint to read the engine's load from")

        def read() -> str:
            with urllib.request.urlopen(f"http://{url}/metrics", timeout=METRICS_TIMEOUT_S) as answer:
                return answer.read().decode(errors="replace")

        try:
            return await asyncio.to_thread(read)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            raise OpenAIError(503, f"the Triton metrics endpoint could not be read: {error}") from error

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        load = engine_load(await metrics_text(), triton_models)
        return [{"dp_rank": 0, "num_reqs": load.running + load.waiting, "num_waiting_reqs": load.waiting,
                 "num_tokens": load.kv_tokens}]

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        load = engine_load(await metrics_text(), triton_models)
        return {"server_load": load.running + load.waiting}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": first.name, "tokenizer_path": first.name, "is_generation": True,
                "served_models": sorted(by_name)}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        try:
            block_size = engine_load(await metrics_text(), triton_models).block_size
        except OpenAIError:
            block_size = None
        return {"model_id": first.name, "model_path": first.name, "served_model_name": first.name,
                "kv_block_size": block_size, "max_model_len": first.max_model_len, "dp_size": 1}

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> JSONResponse:
        note_ignored_fields("/v1/completions/render", body.ignored_fields)
        model = _served(by_name, body.model)
        try:
            prompt = body.prompt_text()
        except ValueError as error:
            raise bad_request(error) from error
        return JSONResponse([_rendered(model, prompt)])

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest, request: Request) -> JSONResponse:
        note_ignored_fields("/v1/chat/completions/render", body.ignored_fields)
        model = _served(by_name, body.model)
        try:
            prompt = model.chat_prompt([m.template_message() for m in body.messages], body.tool_definitions())
        except ValueError as error:
            raise bad_request(error) from error
        return JSONResponse(_rendered(model, prompt))


def _served(by_name: Mapping[str, ServedModel], name: str) -> ServedModel:
    if name not in by_name:
        raise OpenAIError(404, f"model: {name!r} is not served here; available: {sorted(by_name)}", "model")
    return by_name[name]


def _rendered(model: ServedModel, prompt: str) -> dict[str, Any]:
    """The prompt as the engine tokenizes it (``pagedllm.engine.admission.tokenize_prompt``)."""
    if not prompt:
        raise OpenAIError(400, "prompt: is empty", "prompt")
    return {"request_id": uuid.uuid4().hex, "token_ids": list(model.tokenizer.encode(prompt)), "model": model.name}
