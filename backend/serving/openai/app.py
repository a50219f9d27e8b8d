"""The OpenAI-compatible HTTP routes, every request forwarded to tritonserver over gRPC.

``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming as SSE ``data:``
chunks ending with ``data: [DONE]``, or one JSON body) and ``/health``. A streaming
request waits for its first Triton response before answering, so input the engine
refuses still gets a proper 400 rather than an error inside a 200 stream. A client
that disconnects cancels its Triton request (its KV blocks are freed at the next step).
"""
from __future__ import annotations

import asyncio
import gc
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine import latency_trace

from pagedllm.serving.openai.errors import OpenAIError, bad_request, validation_error
from pagedllm.serving.openai.ignored_fields import note_ignored_fields
from pagedllm.serving.openai.lora_adapters import LoRABase, RuntimeAdapters, add_runtime_lora_routes
from pagedllm.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.serving.openai.responses import ResponseBuilder
from pagedllm.serving.openai.router_routes import add_router_routes
from pagedllm.serving.openai.served_models import ServedModel
from pagedllm.serving.openai.tool_choice import tool_calling
from pagedllm.serving.openai.tool_parsers import tool_call_parser
from pagedllm.serving.openai.triton_bridge import GenerateResponse, TritonBridge

T = TypeVar("T")


def build_app(grpc_url: str, models: Sequence[ServedModel], tool_call_parser_name: str | None = None,
              runtime_lora: LoRABase | None = None, metrics_url: str | None = None) -> FastAPI:
    """The FastAPI app serving ``models`` through the tritonserver at ``grpc_url``; ``tool_call_parser_name``
    reads tool calls out of replies to ``tool_choice: "auto"`` (``pagedllm.serving.openai.tool_parsers``);
    ``runtime_lora``: the base whose adapters ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change
    (``None``: those routes do not exist); ``metrics_url``: Triton's metrics endpoint (``host:port``), which the
    routers' probes (``pagedllm.serving.openai.router_routes``) read the engine's load from."""
    by_name = {model.name: model for model in models}
    parser = None if tool_call_parser_name is None else tool_call_parser(tool_call_parser_name)
    bridge: TritonBridge | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal bridge
        bridge = TritonBridge(grpc_url)  # its gRPC channel belongs to this event loop
        # The tokenizers and libraries loaded so far are a few hundred thousand long-lived objects;
        # frozen, the collector stops rescanning them, which otherwise stalls every stream (as vLLM does).
        gc.collect()
        gc.freeze()
        yield
        gc.unfreeze()
        await bridge.close()

    app = FastAPI(title="pagedllm OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response()

    @app.get("/health")
    async def health() -> Response:
        ready = bridge is not None and all([await bridge.is_ready(m.triton_model) for m in models])
        return Response(status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "pagedllm", "root": m.triton_model}
            for m in list(by_name.values())]}

    add_router_routes(app, by_name, lambda: metrics_url)
    if runtime_lora is not None:
        add_runtime_lora_routes(app, RuntimeAdapters(runtime_lora, by_name))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        note_ignored_fields("/v1/completions", body.ignored_fields)
        model = _model(by_name, body.model)
        try:
            prompt, sampling = body.prompt_text(), body.sampling_parameters()
        except ValueError as error:
            raise bad_request(error) from error
        if body.stream and body.echo:
            raise OpenAIError(400, "echo: not supported together with stream", "echo")
        builder = ResponseBuilder("completion", model.name, body.n, echo=prompt if body.echo else "")
        return await _naming_constraint(body.constraint_field, _answer(
            request, _bridge(bridge), model, prompt, sampling, builder, body.stream, body.include_usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        note_ignored_fields("/v1/chat/completions", body.ignored_fields)
        model = _model(by_name, body.model)
        try:
            tools = body.tool_definitions()
            calling = tool_calling(tools, body.tool_choice, parser, body.parallel_tool_calls)
            prompt = model.chat_prompt([m.template_message() for m in body.messages], tools)
            sampling = body.sampling_parameters()
            constraint = None if calling is None else calling.structured_outputs()
            if constraint is not None:
                if "structured_outputs" in sampling:
                    raise ValueError(f"tool_choice: {body.tool_choice!r} constrains the output itself; "
                                     f"drop {body.constraint_field}")
                sampling["structured_outputs"] = constraint
        except ValueError as error:
            raise bad_request(error) from error
        if "max_tokens" not in sampling:  # OpenAI's default: as long as the context allows
            sampling["max_tokens"] = max(1, model.max_model_len - model.count_tokens(prompt))
        builder = ResponseBuilder("chat", model.name, body.n, tool_calling=calling)
        field = body.constraint_field or ("tools" if constraint is not None else None)
        return await _naming_constraint(field, _answer(
            request, _bridge(bridge), model, prompt, sampling, builder, body.stream, body.include_usage))

    return app


async def _naming_constraint(field: str | None, work: Awaitable[T]) -> T:
    """A constraint the engine refused (it names ``structured_outputs``) is the fault of the body field
    that carried it: the 400's ``param`` names that field (``response_format``, ``guided_json``, ...)."""
    try:
        return await work
    except OpenAIError as error:
        if field is not None and error.param == "structured_outputs":
            error.param = field
        raise


def _model(by_name: dict[str, ServedModel], name: str) -> ServedModel:
    if name not in by_name:
        raise OpenAIError(404, f"model: {name!r} is not served here; available: {sorted(by_name)}", "model")
    return by_name[name]


def _bridge(bridge: TritonBridge | None) -> TritonBridge:
    if bridge is None:
        raise OpenAIError(503, "the server is starting")
    return bridge


async def _answer(request: Request, bridge: TritonBridge, model: ServedModel, prompt: str, sampling: dict[str, Any],
                  builder: ResponseBuilder, stream: bool, include_usage: bool) -> Response:
    if model.lora_name is not None:  # an adapter: its base's Triton model, as vllm_backend names adapters
        sampling = {**sampling, "lora_name": model.lora_name}
    request_id = uuid.uuid4().hex
    responses = bridge.generate(model.triton_model, prompt, sampling, stream=stream, request_id=request_id)
    if not stream:
        async def collect() -> dict[str, Any]:
            async for response in responses:
                builder.add(response)
            return builder.response()

        return JSONResponse(await _unless_disconnected(request, collect()))
    try:
        first = await _unless_disconnected(request, anext(responses))
    except StopAsyncIteration:
        raise OpenAIError(500, "tritonserver ended the request without a response") from None
    return StreamingResponse(_sse(builder, first, responses, include_usage, request_id),
                             media_type="text/event-stream")


async def _sse(builder: ResponseBuilder, first: GenerateResponse, rest: AsyncIterator[GenerateResponse],
               include_usage: bool, request_id: str) -> AsyncIterator[str]:
    """The SSE body. Starlette cancels this generator when the client disconnects; closing
    ``rest`` then cancels the Triton request."""
    try:
        opening = builder.role_chunk()
        if opening is not None:
            yield _event(opening)
        for chunk in builder.chunks(first, include_usage):
            latency_trace.mark("door.chunk", request_id)
            yield _event(chunk)
        async for response in rest:
            for chunk in builder.chunks(response, include_usage):
                latency_trace.mark("door.chunk", request_id)
                yield _event(chunk)
        if include_usage:
            yield _event(builder.usage_chunk())
    except OpenAIError as error:  # after the 200 went out, an error can only travel in the stream
        yield _event(error.body())
    finally:
        await rest.aclose()
    yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so its Triton request) if the client goes away first."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise OpenAIError(499, "the client disconnected")
