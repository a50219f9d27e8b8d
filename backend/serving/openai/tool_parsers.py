"""Tool-call parsers: a model family's own tool-call text, turned into OpenAI ``tool_calls``.

``pagedllm serve --tool-call-parser`` picks one for ``tool_choice: "auto"``:

* ``hermes`` (Qwen2.5, Qwen3, Hermes): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first
  call is the message's content.
* ``llama3_json`` (Llama 3.1+): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``), optionally
  after ``<|python_tag|>``.

Text that does not parse as calls stays content, as vLLM's parsers do.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser(Protocol):
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; no calls leaves the text as content."""
        ...

    def content_end(self, text: str) -> int:
        """While streaming: how much of ``text`` is surely content (a call may start after it)."""
        ...


class HermesToolParser:
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
    _START = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self._START)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            calls.append(new_call(call["name"], call.get("arguments", {})))
        content = text[:start]  # as it was streamed: up to the call
        return content if content.strip() else None, calls

    def content_end(self, text: str) -> int:
        return _before_marker(text, self._START)


class Llama3JsonToolParser:
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in body.split(";"):
            try:
                call = json.loads(part)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            calls.append(new_call(call["name"], call.get("parameters", call.get("arguments", {}))))
        return None, calls

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped:
            return 0
        if stripped.startswith("{") or self._TAG.startswith(stripped[: len(self._TAG)]):
            return 0  # the reply may be a call: hold all of it
        return len(text)


TOOL_CALL_PARSERS: dict[str, type[HermesToolParser] | type[Llama3JsonToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def tool_call_parser(name: str) -> ToolCallParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser: {name!r} is not one of {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


def _before_marker(text: str, marker: str) -> int:
    """Where ``marker`` starts in ``text``, or where a partial ``marker`` at its end starts, else its length."""
    found = text.find(marker)
    if found >= 0:
        return found
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)
