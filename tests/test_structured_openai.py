"""Structured outputs through the official ``openai`` client against a real ``pagedllm serve --openai-port``.

One server for the module (``test_openai_server``'s fixtures): ``response_format`` with a
pydantic model (``chat.completions.parse``), json_schema and json_object, vLLM's extra-body
keys, streaming and not, and a schema xgrammar rejects as a 400 naming the field.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from pydantic import BaseModel, Field  # noqa: E402

from test_openai_server import SERVED_NAME, checkpoint, client, serve  # noqa: E402,F401

pytestmark = pytest.mark.tritonserver

MESSAGES = [{"role": "user", "content": "Describe a person."}]
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["name", "age"], "additionalProperties": False}


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
            jsonschema.validate(json.loads(text, strict=False), schema)
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
