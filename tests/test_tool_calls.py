"""Tool calling without a server: the parsers, tool_choice's constraints, and the response bodies and stream chunks."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm.serving.openai.responses import ResponseBuilder
from pagedllm.serving.openai.tool_choice import tool_calling
from pagedllm.serving.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser, tool_call_parser
from pagedllm.serving.openai.triton_bridge import GenerateResponse, SampleDelta

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
HERMES_REPLY = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def test_hermes_parser_reads_every_call_and_the_content_before_them() -> None:
    content, calls = HermesToolParser().parse(HERMES_REPLY)
    assert content == "Let me look. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert HermesToolParser().parse("no calls here") == ("no calls here", [])
    assert HermesToolParser().parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])


def test_hermes_parser_holds_back_what_may_start_a_call() -> None:
    parser = HermesToolParser()
    assert parser.content_end("Hello <tool_c") == len("Hello ")
    assert parser.content_end("Hello <tool_call>{") == len("Hello ")
    assert parser.content_end("Hello world") == len("Hello world")


def test_llama3_json_parser() -> None:
    parser = Llama3JsonToolParser()
    content, calls = parser.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    assert parser.parse("plain text") == ("plain text", [])
    assert parser.content_end(" {") == 0 and parser.content_end("Sure") == 4


def test_required_and_named_constrain_to_the_functions_schemas() -> None:
    required = tool_calling(TOOLS, "required", None, None)
    schema = required.structured_outputs()["json"]
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    assert tool_calling(TOOLS, "required", None, False).structured_outputs()["json"]["maxItems"] == 1
    named = tool_calling(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.structured_outputs() == {"json": WEATHER}
    assert named.extract('{"city": "Oslo"}')[1][0].name == "get_weather"


@pytest.mark.parametrize("tools, choice, parser, message", [
    (None, "required", None, "needs tools"),
    (TOOLS, "auto", None, "--tool-call-parser"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "no tool named 'nope'"),
    (TOOLS, "sometimes", None, "must be"),
])
def test_bad_tool_choices_name_the_field(tools, choice, parser, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        tool_calling(tools, choice, parser, None)
    assert str(error.value).startswith("tool_choice:")
    assert tool_calling(TOOLS, "none", None, None) is None


def reply(text: str, finish: str | None) -> GenerateResponse:
    return GenerateResponse(7, (SampleDelta(0, text, 1, finish, None),))


def test_auto_reply_becomes_tool_calls_whole_and_streamed() -> None:
    calling = tool_calling(TOOLS, "auto", tool_call_parser("hermes"), None)
    whole = ResponseBuilder("chat", "m", 1, tool_calling=calling)
    whole.add(reply(HERMES_REPLY, "stop"))
    (choice,) = whole.response()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look. "
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]

    streamed = ResponseBuilder("chat", "m", 1, tool_calling=calling)
    pieces = [HERMES_REPLY[:8], HERMES_REPLY[8:20], HERMES_REPLY[20:60], HERMES_REPLY[60:]]
    chunks = []
    for index, piece in enumerate(pieces):
        chunks += streamed.chunks(reply(piece, "stop" if index == len(pieces) - 1 else None), include_usage=False)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Let me look. "
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_reply_cut_by_max_tokens_stays_content() -> None:
    calling = tool_calling(TOOLS, "required", None, None)
    builder = ResponseBuilder("chat", "m", 1, tool_calling=calling)
    builder.add(reply('[{"name": "get_wea', "length"))
    (choice,) = builder.response()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == '[{"name": "get_wea'
    assert "tool_calls" not in choice["message"]


def test_without_a_parser_tools_default_to_none_and_auto_is_refused() -> None:
    assert tool_calling(TOOLS, None, None, None) is None
    assert tool_calling(TOOLS, None, tool_call_parser("hermes"), None).mode == "auto"


def test_a_named_functions_arguments_stream_as_they_come() -> None:
    calling = tool_calling(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    builder = ResponseBuilder("chat", "m", 1, tool_calling=calling)
    pieces = ['{"ci', 'ty": "Os', 'lo"}']
    chunks = []
    for index, piece in enumerate(pieces):
        chunks += builder.chunks(reply(piece, "stop" if index == len(pieces) - 1 else None), include_usage=False)
    parts = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks]
    assert len(parts) == 3 and parts[0]["id"].startswith("call_") and parts[0]["function"]["name"] == "get_weather"
    assert all("id" not in part for part in parts[1:])
    assert json.loads("".join(part["function"]["arguments"] for part in parts)) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
