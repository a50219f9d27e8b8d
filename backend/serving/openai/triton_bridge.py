"""Send one generate request to tritonserver over gRPC streaming (asyncio) and read its responses.

Each request gets its own ``ModelStreamInfer`` call on one shared channel: the request
iterator sends the single request and half-closes, Triton ends the call after the
request's last response, and cancelling the call (a client went away) makes Triton
cancel the request, so the backend aborts it and frees its KV blocks at the next
engine step. The tensors are the model's vllm_backend-compatible ones
(``pagedllm.serving.triton.request_codec``): the prompt is always excluded from the output,
the token counts and finish reasons are always asked for, logprobs when wanted.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from pagedllm.engine import latency_trace
from pagedllm.serving.openai.errors import OpenAIError, engine_rejection
from pagedllm.serving.triton.request_codec import SPARSE_OUTPUTS

_INVALID_REQUEST = "invalid request:"  # how backend/serving/triton/model.py begins its INVALID_ARG messages


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated (or, with echo, prompt) token's logprob; ``alternatives`` are the requested top-k, best
    first. The first prompt token has no logprob (``None``): nothing comes before it."""

    token: str
    logprob: float | None
    alternatives: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class SampleDelta:
    """What one of the ``n`` samples gained in one Triton response."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None


@dataclass(frozen=True, slots=True)
class GenerateResponse:
    num_prompt_tokens: int | None  # in a request's first response only
    samples: tuple[SampleDelta, ...]
    # With sampling["prompt_logprobs"]: every prompt token's, in the one response that carries them.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class TritonBridge:
    """An asyncio gRPC client of one tritonserver; create it inside the event loop that uses it."""

    def __init__(self, grpc_url: str) -> None:
        self._client = grpcclient.InferenceServerClient(grpc_url)

    async def close(self) -> None:
        await self._client.close()

    async def is_ready(self, model: str) -> bool:
        try:
            return bool(await self._client.is_model_ready(model))
        except InferenceServerException:
            return False

    async def generate(self, model: str, prompt: str, sampling: Mapping[str, Any], *, stream: bool,
                       request_id: str | None = None) -> AsyncIterator[GenerateResponse]:
        """Yield the request's responses (one per engine step when streaming, else one); ``request_id``
        (default: a fresh uuid) is the Triton request's id.

        Raises ``OpenAIError``: 400 for input the backend refused, 503 when Triton cannot
        be reached or does not serve ``model``, 500 for anything else it reports.
        """
        request_id = request_id or uuid.uuid4().hex
        request = {"model_name": model, "inputs": _inputs(prompt, sampling, stream), "request_id": request_id}

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request

        latency_trace.mark("door.forwarded", request_id)
        call = self._client.stream_infer(one_request())
        top_logprobs: int | None = sampling.get("logprobs")
        try:
            async for result, error in call:
                latency_trace.mark("door.response", request_id)
                if error is not None:
                    raise _as_openai_error(str(error))
                yield _decode(result, top_logprobs, sampling.get("prompt_logprobs"))
        except InferenceServerException as error:
            raise _as_openai_error(str(error)) from error
        except grpc.aio.AioRpcError as error:  # the call itself failed: Triton is down or went away
            status = 503 if error.code() == grpc.StatusCode.UNAVAILABLE else 500
            raise OpenAIError(status, f"the Triton server could not be reached: {error.details()}") from error
        finally:
            call.cancel()  # a no-op once Triton has ended the call; otherwise cancels the request


def _inputs(prompt: str, sampling: Mapping[str, Any], stream: bool) -> list[grpcclient.InferInput]:
    tensors = [
        ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
        ("stream", np.array([stream]), "BOOL"),
        ("exclude_input_in_output", np.array([True]), "BOOL"),
        *((name, np.array([True]), "BOOL") for name in (
            "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")),
        # The prompt length with the first response only, finish reasons once a sample ends: two output
        # tensors per streamed token instead of four (pagedllm.serving.triton.request_codec.ReturnFlags.sparse).
        (SPARSE_OUTPUTS, np.array([True]), "BOOL"),
        # Only when asked: the backend would otherwise encode a JSON "null" per sample per step.
        ("return_logprobs", np.array([sampling.get("logprobs") is not None]), "BOOL"),
    ]
    inputs = []
    for name, array, dtype in tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _decode(result: grpcclient.InferResult, top_logprobs: int | None,
            prompt_top_logprobs: int | None = None) -> GenerateResponse:
    texts = result.as_numpy("text_output")
    reasons = result.as_numpy("finish_reason")  # None: no sample has finished (sparse outputs)
    counts = result.as_numpy("num_output_tokens")
    logprobs: list[tuple[TokenLogprob, ...] | None] = [None] * len(texts)
    if top_logprobs is not None:
        logprobs = [_token_logprobs(encoded, top_logprobs) for encoded in result.as_numpy("logprobs")]
    prompt_tokens = result.as_numpy("num_input_tokens")  # None after the first response (sparse outputs)
    samples = tuple(
        SampleDelta(
            index=index,
            text=texts[index].decode("utf-8"),
            num_tokens=int(counts[index]),
            finish_reason=None if reasons is None or reasons[index] == b"None" else reasons[index].decode(),
            logprobs=logprobs[index],
        )
        for index in range(len(texts))
    )
    prompt_logprobs = None
    if prompt_top_logprobs is not None and (encoded := result.as_numpy("prompt_logprobs")) is not None:
        prompt_logprobs = _token_logprobs(encoded[0], prompt_top_logprobs)
    return GenerateResponse(None if prompt_tokens is None else int(prompt_tokens[0]), samples, prompt_logprobs)


def _token_logprobs(encoded: bytes, top_k: int) -> tuple[TokenLogprob, ...]:
    """The backend's per-token JSON objects (sampled token first, then the others) as ``TokenLogprob``s.

    Each object holds the top ``top_k`` tokens plus the sampled one when it is not among
    them (ranked ``top_k + 1``); a prompt's first token has rank and logprob null.
    """
    tokens = []
    for entry in json.loads(encoded):
        candidates = list(entry.values())
        top = sorted((c for c in candidates if c["rank"] is not None and c["rank"] <= top_k), key=lambda c: c["rank"])
        sampled = candidates[0]
        tokens.append(TokenLogprob(sampled["decoded_token"], sampled["logprob"],
                                   tuple((c["decoded_token"], c["logprob"]) for c in top)))
    return tuple(tokens)


def _as_openai_error(message: str) -> OpenAIError:
    if _INVALID_REQUEST in message:
        return engine_rejection(message[message.index(_INVALID_REQUEST) + len(_INVALID_REQUEST):].strip())
    if "Request for unknown model" in message or "failed to connect" in message.lower():
        return OpenAIError(503, f"the Triton server cannot serve this request: {message}")
    return OpenAIError(500, f"the Triton server failed the request: {message}")
