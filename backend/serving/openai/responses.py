"""Build OpenAI response bodies (whole, or SSE chunks) from the Triton bridge's responses.

One ``ResponseBuilder`` per request: ``chunks()`` turns each Triton response into the
stream's chunks, one per sample that gained text or finished; ``response()`` gives the
non-streaming body from everything added. Either way ``usage`` counts the prompt tokens
the engine saw and the tokens every sample generated.

With tool calling (:mod:`pagedllm.serving.openai.tool_choice`) a chat reply's calls come back
as ``tool_calls`` (finish reason ``tool_calls``). A stream sends content only as far as no call
can have started, and each call, once its sample has finished, as one OpenAI tool-call delta
(``index``, ``id``, ``type``, ``function`` with its name and whole arguments); a named
function's arguments, which are the whole reply, stream as they come (the first delta
carries the id and name, the next ones more ``arguments``).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedllm.serving.openai.tool_choice import ToolCalling
from pagedllm.serving.openai.tool_parsers import new_call_id
from pagedllm.serving.openai.triton_bridge import GenerateResponse, SampleDelta, TokenLogprob

Kind = Literal["chat", "completion"]


@dataclass(slots=True)
class _Choice:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    sent: int = 0  # tool calling, streaming: characters of text already sent (content, or a named call's arguments)
    call_id: str | None = None  # tool calling, streaming a named function's arguments: the call's id


@dataclass(slots=True)
class ResponseBuilder:
    kind: Kind
    model: str
    n: int
    echo: str = ""  # completions with echo: the prompt, put before each choice's text
    tool_calling: ToolCalling | None = None  # chat with tools: read calls out of the replies
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    _choices: list[_Choice] = field(default_factory=list)
    # Completions with echo and logprobs: the prompt tokens', which each choice's logprobs start with.
    _prompt_logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        self._choices = [_Choice() for _ in range(self.n)]
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id

    def add(self, response: GenerateResponse) -> None:
        if response.num_prompt_tokens is not None:
            self.prompt_tokens = response.num_prompt_tokens
        if response.prompt_logprobs is not None:
            self._prompt_logprobs = list(response.prompt_logprobs)
        for sample in response.samples:
            choice = self._choices[sample.index]
            choice.text += sample.text
            self.completion_tokens += sample.num_tokens
            choice.finish_reason = sample.finish_reason or choice.finish_reason
            if sample.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + list(sample.logprobs)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def response(self) -> dict[str, Any]:
        """The non-streaming body."""
        choices = []
        for index, choice in enumerate(self._choices):
            logprobs = None if choice.logprobs is None else self._logprobs(choice.logprobs, len(self.echo))
            if logprobs is not None and self._prompt_logprobs is not None:
                logprobs = _joined(self._logprobs(self._prompt_logprobs, 0), logprobs)
            finish_reason = choice.finish_reason
            if self.kind == "chat":
                body: dict[str, Any] = {"message": {"role": "assistant", "content": choice.text}}
                if self.tool_calling is not None:
                    content, calls = self.tool_calling.extract(choice.text)
                    if calls:
                        body["message"] = {"role": "assistant", "content": content,
                                           "tool_calls": [call.as_openai() for call in calls]}
                        finish_reason = "tool_calls"
            else:
                body = {"text": self.echo + choice.text}
            choices.append({"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason})
        return {**self._envelope(stream=False), "choices": choices, "usage": self.usage()}

    def role_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role, one delta per choice (as OpenAI's do)."""
        if self.kind != "chat":
            return None
        return {**self._envelope(stream=True), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.n)]}

    def chunks(self, response: GenerateResponse, include_usage: bool) -> list[dict[str, Any]]:
        """The stream chunks for one Triton response; ``usage`` is null in each when it will follow at the end."""
        offsets = [len(self.echo + c.text) for c in self._choices]
        self.add(response)
        if self.tool_calling is not None and self.kind == "chat":
            return self._tool_chunks(response, include_usage)
        chunks = []
        for sample in response.samples:
            if not sample.text and sample.finish_reason is None and not sample.logprobs:
                continue
            chunk = {**self._envelope(stream=True), "choices": [self._chunk_choice(sample, offsets[sample.index])]}
            if include_usage:
                chunk["usage"] = None
            chunks.append(chunk)
        return chunks

    def _tool_chunks(self, response: GenerateResponse, include_usage: bool) -> list[dict[str, Any]]:
        calling = self.tool_calling
        if calling is None:
            return []
        chunks = []
        for sample in response.samples:
            choice = self._choices[sample.index]
            deltas: list[tuple[dict[str, Any], str | None]] = []
            if calling.mode == "named":
                if len(choice.text) > choice.sent or sample.finish_reason is not None or choice.call_id is None:
                    deltas.append(self._named_arguments(choice, calling.name or "", sample.finish_reason))
            elif sample.finish_reason is None:
                end = calling.content_end(choice.text)
                if end > choice.sent:
                    deltas.append(({"content": choice.text[choice.sent:end]}, None))
                    choice.sent = end
            else:
                content, calls = calling.extract(choice.text)
                rest = (content or "")[choice.sent:] if calls else choice.text[choice.sent:]
                if calls:
                    if rest:
                        deltas.append(({"content": rest}, None))
                    deltas.append(({"tool_calls": [{"index": i, **call.as_openai()} for i, call in enumerate(calls)]},
                                   "tool_calls"))
                else:
                    deltas.append(({"content": rest}, sample.finish_reason))
                choice.sent = len(choice.text)
            for delta, finish_reason in deltas:
                chunk = {**self._envelope(stream=True), "choices": [
                    {"index": sample.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
                if include_usage:
                    chunk["usage"] = None
                chunks.append(chunk)
        return chunks

    @staticmethod
    def _named_arguments(choice: _Choice, name: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The next delta of a named function's call: its arguments are the reply, sent as they come."""
        part: dict[str, Any] = {"index": 0, "function": {"arguments": choice.text[choice.sent:]}}
        if choice.call_id is None:
            choice.call_id = new_call_id()
            part = {"index": 0, "id": choice.call_id, "type": "function",
                    "function": {"name": name, "arguments": part["function"]["arguments"]}}
        choice.sent = len(choice.text)
        return {"tool_calls": [part]}, "tool_calls" if finish_reason == "stop" else finish_reason

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(stream=True), "choices": [], "usage": self.usage()}

    def _chunk_choice(self, sample: SampleDelta, text_offset: int) -> dict[str, Any]:
        logprobs = None if sample.logprobs is None else self._logprobs(list(sample.logprobs), text_offset)
        body = {"delta": {"content": sample.text}} if self.kind == "chat" else {"text": sample.text}
        return {"index": sample.index, **body, "logprobs": logprobs, "finish_reason": sample.finish_reason}

    def _envelope(self, stream: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if stream and self.kind == "chat" else ""),
                "created": self.created, "model": self.model}

    def _logprobs(self, tokens: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [{**_token(t.token, t.logprob),
                                 "top_logprobs": [_token(text, logprob) for text, logprob in t.alternatives]}
                                for t in tokens]}
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token.token)
        return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.logprob is None else dict(t.alternatives) for t in tokens],
                "text_offset": offsets}


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Completions logprobs of the prompt followed by those of the completion."""
    return {key: first[key] + then[key] for key in first}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
