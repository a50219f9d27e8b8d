"""Structured outputs and tool calling through a real ``pagedllm serve --openai-port --tool-call-parser hermes``.

One server for the module, on the tiny llama with a Hermes-style chat template written
here. The official ``openai`` client: ``response_format`` with a pydantic model
(``chat.completions.parse``), json_schema and json_object, vLLM's extra-body keys, tools
with ``tool_choice`` required, named, auto and none, streaming and not, and a schema
xgrammar rejects as a 400 naming the field. tritonclient gRPC streaming on the same
server: the offline outputs for each way ``sampling_parameters`` takes a constraint, and
INVALID_ARG naming ``structured_outputs`` for a bad one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dataclasses import dataclass

import jsonschema
import numpy as np
import pytest

from installed import need
openai = need("openai")
grpcclient = need("tritonclient.grpc")

from pydantic import BaseModel, Field  # noqa: E402

from transformers import AutoTokenizer  # noqa: E402

from serve_process import follow, kill, wait_ready  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.platform.processes import free_port  # noqa: E402
from pagedllm.testing.hub_cache import add_to_hub_cache  # noqa: E402
from pagedllm.testing.structured_corpus import ARITHMETIC_EBNF, JSON_SCHEMAS, REGEXES  # noqa: E402
from test_openai_server import REPO_ID, SERVED_NAME, Serve  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

MESSAGES = [{"role": "user", "content": "Describe a person."}]
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["name", "age"], "additionalProperties": False}


HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>\nYou may call these tools:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|tool|>\n<tool_response>{{ message.content }}</tool_response>\n"
    "{%- elif message.tool_calls is defined %}<|assistant|>\n"
    "{%- for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>\n{% endfor %}"
    "{%- else %}<|{{ message.role }}|>\n{{ message.content }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 160, "max_model_len": 1024}
TRITON_MODEL = "llm"  # what pagedllm serve --model names the model in its generated repository


@dataclass
class StructuredServe(Serve):
    grpc_url: str = ""


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    snapshot = add_to_hub_cache(tmp_path_factory.mktemp("hf_home") / "hub", REPO_ID, tiny_model_dir("llama"))
    (snapshot / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return snapshot


@pytest.fixture(scope="module")
def serve(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StructuredServe]:
    hf_home = checkpoint.parents[3]
    tmpdir = tmp_path_factory.mktemp("serve-tmp")
    grpc, http, metrics, port = free_port(), free_port(), free_port(), free_port()
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    engine_args = [part for key, value in ENGINE_ARGS.items() for part in ("--engine-arg", f"{key}={value}")]
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", REPO_ID, "--served-model-name", SERVED_NAME,
               *engine_args, "--host", "127.0.0.1", "--grpc-port", str(grpc),
               "--http-port", str(http), "--metrics-port", str(metrics), "--openai-port", str(port),
               "--tool-call-parser", "hermes"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = StructuredServe(process, tmpdir, f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{metrics}/metrics",
                              grpc_url=f"127.0.0.1:{grpc}")
    follow(process, running.output)
    try:
        wait_ready(process, running.output)
        yield running
    finally:
        kill(process)


@pytest.fixture(scope="module")
def client(serve: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=120)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=SERVED_NAME, messages=MESSAGES, response_format=Person,
                                               max_tokens=60, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object(client: openai.OpenAI, stream: bool) -> None:
    formats = [({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}},
                PERSON_SCHEMA), ({"type": "json_object"}, {"type": "object"})]
    for response_format, schema in formats:
        kwargs = dict(model=SERVED_NAME, messages=MESSAGES, response_format=response_format, max_tokens=60,
                      temperature=0, seed=1)
        if stream:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
        if response_format["type"] == "json_schema":
            jsonschema.validate(json.loads(text), schema)
        else:
            assert text.startswith("{")


def test_vllm_extra_body_keys(client: openai.OpenAI) -> None:
    bodies = [({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
              ({"guided_regex": r"[a-z]{3}-\d{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
              ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
              ({"guided_json": PERSON_SCHEMA}, lambda t: jsonschema.validate(json.loads(t, strict=False),
                                                                              PERSON_SCHEMA) is None)]
    for extra_body, valid in bodies:
        text = client.completions.create(model=SERVED_NAME, prompt="Answer:", max_tokens=60, temperature=0,
                                         extra_body=extra_body).choices[0].text
        assert valid(text), (extra_body, text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_xgrammar_rejects_is_a_400_naming_response_format(client: openai.OpenAI, stream: bool) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as error:
        response = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, response_format=bad,
                                                  max_tokens=5, stream=stream)
        if stream:
            list(response)
    assert error.value.body["param"] == "response_format"
    assert "xgrammar" in error.value.body["message"]


def test_two_constraints_are_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=5,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert error.value.body["param"] == "guided_regex"


def assert_calls(calls: list[dict[str, Any]], names: set[str] | None = None) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert names is None or call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def streamed_calls(chunks: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, tool calls and finish reason accumulated from stream chunks as OpenAI's SDKs do."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                call["id"] = part.id or call["id"]
                call["function"]["name"] += part.function.name or ""
                call["function"]["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def ask(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
    request = dict(model=SERVED_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                   max_tokens=80, temperature=0, **kwargs)
    if stream:
        return streamed_calls(client.chat.completions.create(stream=True, **request))
    choice = client.chat.completions.create(**request).choices[0]
    calls = [call.model_dump() for call in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client: openai.OpenAI, stream: bool) -> None:
    # One call: a noisy model would otherwise keep appending calls to the list until max_tokens.
    _, calls, finish = ask(client, stream, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1
    assert_calls(calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = ask(client, stream, tool_choice=named)
    assert finish == "tool_calls" and not content and len(calls) == 1
    assert_calls(calls, {"get_time"})


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_the_hermes_text(client: openai.OpenAI, stream: bool) -> None:
    # The noisy model is made to write a Hermes tool call; the server's parser must read it back.
    regex = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Tokyo)", "days": [1-7]\}\}</tool_call>'
    content, calls, finish = ask(client, stream, tool_choice="auto", extra_body={"guided_regex": regex})
    assert finish == "tool_calls" and content == "Checking. "
    assert_calls(calls, {"get_weather"})


def test_tool_choice_none_and_tools_reach_the_template(client: openai.OpenAI, checkpoint: Path) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    response = client.chat.completions.create(model=SERVED_NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                              max_tokens=5, temperature=0)
    assert not response.choices[0].message.tool_calls
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "get_weather" in prompt
    assert response.usage.prompt_tokens == len(tokenizer(prompt).input_ids)


PROMPT = "Answer in the format:"
# The same constraints in each of the ways Triton's sampling_parameters take them.
REQUESTS = [
    {"structured_outputs": {"json": JSON_SCHEMAS[15]}},
    {"structured_outputs": json.dumps({"json": json.dumps(JSON_SCHEMAS[1])})},
    {"guided_decoding": {"regex": REGEXES[0]}},
    {"structured_outputs": {"choice": ["red", "green", "blue"]}},
    {"structured_outputs": {"grammar": ARITHMETIC_EBNF}},
]


def infer(url: str, params: dict[str, Any], stream: bool) -> tuple[str, str | None, str | None]:
    """One request on a gRPC stream: its whole text, finish reason, and the error if any."""
    texts: list[str] = []
    reasons: list[str] = []
    errors: list[str] = []
    done = threading.Event()

    def on_response(result: Any, error: Any) -> None:
        if error is not None:
            errors.append(str(error))
            done.set()
            return
        text = result.as_numpy("text_output")
        if text is not None:
            texts.append(text[0].decode())
            reasons.append(result.as_numpy("finish_reason")[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    inputs = []
    for name, array, kind in (
        ("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
        ("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
        ("stream", np.array([stream]), "BOOL"),
        ("exclude_input_in_output", np.array([True]), "BOOL"),
        ("return_finish_reason", np.array([True]), "BOOL"),
    ):
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer(TRITON_MODEL, inputs, request_id="structured", enable_empty_final_response=True)
        assert done.wait(120), "no final response"
    finally:
        client.stop_stream()
        client.close()
    return "".join(texts), reasons[-1] if reasons else None, errors[0] if errors else None


@pytest.mark.parametrize("stream", [False, True])
def test_triton_constraints_give_the_offline_outputs(serve: StructuredServe, checkpoint: Path, stream: bool) -> None:
    sampling = [{"temperature": 0.8, "seed": i, "max_tokens": 120, **extra} for i, extra in enumerate(REQUESTS)]
    llm = LLM(str(checkpoint), **ENGINE_ARGS)
    offline = llm.generate([PROMPT] * len(sampling), [_offline_params(values) for values in sampling])
    for values, expected in zip(sampling, offline):
        text, reason, error = infer(serve.grpc_url, values, stream)
        assert error is None
        assert (text, reason) == (expected.outputs[0].text, expected.outputs[0].finish_reason) == (text, "stop")


def _offline_params(values: dict[str, Any]) -> SamplingParams:
    values = dict(values)
    if "guided_decoding" in values:
        values["structured_outputs"] = values.pop("guided_decoding")
    return SamplingParams.from_dict(values)


@pytest.mark.parametrize("constraint, reason", [
    ({"json": {"type": "objectx"}}, "rejected by xgrammar"),  # found when it compiles, in the engine
    ({"json": {"enum": [f"value-{i}" for i in range(100_000)]}}, "at most 65536"),  # refused up front
])
def test_triton_bad_constraint_is_invalid_arg_naming_the_field(serve: StructuredServe, constraint: dict[str, Any],
                                                                reason: str) -> None:
    _, _, error = infer(serve.grpc_url, {"max_tokens": 8, "structured_outputs": constraint}, stream=True)
    # "invalid request:" is how backend/serving/triton/model.py opens its INVALID_ARG messages (a stream error carries no code).
    assert error is not None and error.startswith("invalid request:") and "SamplingParams.structured_outputs" in error
    assert reason in error
    text, reason_after, error = infer(serve.grpc_url, {"max_tokens": 4, "temperature": 0}, stream=False)
    assert error is None and reason_after == "length"  # serving carries on
