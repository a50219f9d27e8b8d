"""OpenAI request bodies, as pydantic models, and their translation to the backend's sampling parameters.

The fields listed here are validated strictly: a bad value is a 400 naming the field.
A top-level field this door does not know is accepted and ignored (logged once per
name, ``pagedllm.serving.openai.ignored_fields``), as vLLM's server does, because routers
add their own fields to every request; nested objects still refuse unknown keys. Beyond OpenAI's
fields, vLLM's usual extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``) pass through, since the engine
has them. Ranges are checked by the engine (``SamplingParams``), whose message comes
back as the 400's text.

Structured outputs: ``response_format`` (``text``, ``json_object``, ``json_schema``) and
vLLM's extra-body keys (``structured_outputs``, and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``) become the engine's
``structured_outputs``; at most one of them may be given.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # routers' own fields: see ignored_fields

    model: str
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def ignored_fields(self) -> list[str]:
        """The body's top-level fields this door does not know."""
        return list(self.model_extra or ())

    @property
    def constraint_field(self) -> str | None:
        """The body field that carries the output constraint, if one does."""
        given = [name for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give one output constraint, not {', '.join(given)}")
        return given[0] if given else None

    def _structured_outputs(self) -> dict[str, Any] | None:
        field = self.constraint_field
        if field is None:
            return None
        if field == "response_format":
            response_format = self.response_format
            if response_format is None or response_format.type == "json_object":
                return {"json_object": True}
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            return {"json": response_format.json_schema.schema_}
        if field == "structured_outputs":
            return self.structured_outputs
        key = field.removeprefix("guided_")
        return {key: getattr(self, field)}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        values = {
            "n": self.n, "stop": stop, "max_tokens": max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids, "logprobs": logprobs,
            "structured_outputs": self._structured_outputs(),
        }
        return {key: value for key, value in values.items() if value is not None}


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (a string, or a list holding one string)."""

    prompt: str | list[str]
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError(f"prompt: a list must hold exactly one prompt here, got {len(self.prompt)}")
        return self.prompt[0]

    def sampling_parameters(self) -> dict[str, Any]:
        sampling = self._sampling(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the prompt's logprobs too, as lm-evaluation-harness reads them
            sampling["prompt_logprobs"] = self.logprobs
        return sampling


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the chat template decides

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates expect it; text parts of a list content are joined."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages: only text content parts are supported, got {part.get('type')!r}")
                texts.append(part["text"])
            message["content"] = "".join(texts)
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def sampling_parameters(self) -> dict[str, Any]:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(self.max_completion_tokens or self.max_tokens, logprobs)

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        """The tools as OpenAI sends them (``{"type": "function", "function": {...}}``), for the chat template."""
        return None if not self.tools else [tool.model_dump(exclude_none=True) for tool in self.tools]
