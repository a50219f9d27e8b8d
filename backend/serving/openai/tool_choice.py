"""How a chat request's ``tools`` and ``tool_choice`` shape its generation and its reply.

* ``"none"`` (the default without tools, or without a ``--tool-call-parser``): plain content; the
  tools still reach the chat template.
* a named function: the output is constrained to that function's parameter schema and
  the whole reply is its arguments;
* ``"required"``: the output is constrained to a JSON list of one or more
  ``{"name", "arguments"}`` calls of the given tools (one, with ``parallel_tool_calls: false``),
  so the arguments always match their function's schema;
* ``"auto"`` (the default with tools on a server with a ``--tool-call-parser``): the model writes
  what it likes, and that parser reads its family's tool-call text out of the reply.

A reply holding calls finishes with ``finish_reason: "tool_calls"``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pagedllm.serving.openai.tool_parsers import ToolCall, ToolCallParser, new_call

Mode = Literal["named", "required", "auto"]


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """One request's tool calling: how to constrain its output, and how to read calls out of it."""

    mode: Mode
    tools: tuple[dict[str, Any], ...]  # OpenAI's function definitions: name, description, parameters
    name: str | None = None  # the named function
    parser: ToolCallParser | None = None  # auto
    parallel: bool = True

    def structured_outputs(self) -> dict[str, Any] | None:
        if self.mode == "named":
            return {"json": self._parameters(self.name)}
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": tool["name"]},
                                                       "arguments": self._parameters(tool["name"])},
                      "required": ["name", "arguments"], "additionalProperties": False} for tool in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return {"json": schema}
        return None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; a reply cut short (``max_tokens``) stays content."""
        if self.mode == "named":
            try:
                json.loads(text, strict=False)
            except json.JSONDecodeError:
                return text, []
            return None, [new_call(self.name or "", text)]
        if self.mode == "required":
            try:
                calls = json.loads(text, strict=False)
            except json.JSONDecodeError:
                return text, []
            return None, [new_call(call["name"], call["arguments"]) for call in calls]
        if self.parser is None:
            return text, []
        return self.parser.parse(text)

    def content_end(self, text: str) -> int:
        """While streaming: how much of ``text`` can go out as content now."""
        if self.mode != "auto" or self.parser is None:
            return 0  # the whole reply is the calls
        return self.parser.content_end(text)

    def _parameters(self, name: str | None) -> dict[str, Any]:
        for tool in self.tools:
            if tool["name"] == name:
                return tool.get("parameters") or {"type": "object", "properties": {}}
        raise ValueError(f"tool_choice: no tool named {name!r} in tools")


def tool_calling(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                 parser: ToolCallParser | None, parallel: bool | None) -> ToolCalling | None:
    """The request's ``ToolCalling``, or None for plain content; ``ValueError`` names the field at fault."""
    functions = tuple(tool["function"] for tool in tools or ())
    if not functions:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
        return None
    choice = ("none" if parser is None else "auto") if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        if parser is None:
            raise ValueError('tool_choice: "auto" needs the server started with --tool-call-parser '
                             '(hermes or llama3_json); use "required" or a named function otherwise')
        return ToolCalling("auto", functions, parser=parser)
    if choice == "required":
        return ToolCalling("required", functions, parallel=parallel is not False)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in {function["name"] for function in functions}:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools")
        return ToolCalling("named", functions, name=name)
    raise ValueError(f'tool_choice: must be "none", "auto", "required" or a named function, got {choice!r}')
