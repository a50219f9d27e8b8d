"""Length-bounded strings stay strict JSON: the rewrite of minLength/maxLength into a pattern.

The oracle is Python's own JSON: a string's JSON text is accepted exactly when the string's
length (in code points, as JSON Schema counts) is within the bounds, whichever way
``json.dumps`` escapes it; raw control characters are never accepted.
"""
from __future__ import annotations

import copy
import json
import random
import re
from typing import Any

import pytest
import xgrammar as xgr

from pagedllm.engine.json_string_bounds import bounded_strings_as_patterns

# Each an awkward character for a JSON string: escapes, a control byte, a quote, non-ASCII, non-BMP.
ALPHABET = ["a", "Z", " ", "\"", "\\", "/", "\n", "\t", "\x13", "\x00", "\x7f", "é", "日", "😀", "\u2028"]


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    # Matching a string does not depend on the vocabulary, so any small one will do.
    return xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b"]), max_threads=1, cache_enabled=False)


def accepts(compiler: xgr.GrammarCompiler, schema: Any, text: str, rewrite: bool = True) -> bool:
    if rewrite:
        schema = bounded_strings_as_patterns(schema)
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    return matcher.accept_string(text) and matcher.is_completed()


def raw_controls(text: str) -> str:
    """JSON text with its ``\\u00XX`` control escapes written as the raw characters strict JSON forbids."""
    return re.sub(r"\\u00([01][0-9a-f])", lambda match: chr(int(match.group(1), 16)), text)


def bounded(min_length: int | None = None, max_length: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    if min_length is not None:
        schema["minLength"] = min_length
    if max_length is not None:
        schema["maxLength"] = max_length
    return schema


def test_the_installed_xgrammar_still_has_the_bug_this_works_around(compiler: xgr.GrammarCompiler) -> None:
    """When this fails, xgrammar was fixed (mlc-ai/xgrammar#800): drop the rewrite."""
    schema = {"type": "object", "properties": {"t": bounded(max_length=4)}, "required": ["t"]}
    assert accepts(compiler, schema, '{"t": "a\x13"}', rewrite=False)
    assert not accepts(compiler, schema, '{"t": "a\\n"}', rewrite=False)
    assert not accepts(compiler, schema, '{"t": "a\x13"}')
    assert accepts(compiler, schema, '{"t": "a\\n"}')


@pytest.mark.parametrize("min_length, max_length", [(None, 4), (2, None), (1, 3), (0, 0), (3, 3)])
def test_json_text_is_accepted_exactly_when_the_decoded_length_is_within_bounds(
        compiler: xgr.GrammarCompiler, min_length: int | None, max_length: int | None) -> None:
    schema = bounded(min_length, max_length)
    rng = random.Random(f"{min_length}-{max_length}")
    low, high = min_length or 0, max_length if max_length is not None else 10**9
    for _ in range(60):
        value = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 7)))
        within = low <= len(value) <= high
        for ensure_ascii in (True, False):
            text = json.dumps(value, ensure_ascii=ensure_ascii)
            assert accepts(compiler, schema, text) == within, (text, len(value))


@pytest.mark.parametrize("text, length", [
    ('"\\ud83d\\ude00"', 1),  # a surrogate pair is one code point
    ('"\\u00e9\\/\\""', 3),
    ('"\\u0000"', 1),
])
def test_escapes_count_as_the_characters_they_decode_to(compiler: xgr.GrammarCompiler, text: str,
                                                       length: int) -> None:
    assert len(json.loads(text)) == length
    assert accepts(compiler, bounded(length, length), text)
    assert not accepts(compiler, bounded(length + 1, length + 1), text)


@pytest.mark.parametrize("text", ['"\x13"', '"\\"', '"\\x41"', '"\\ud83d"', '"\\ude00"', '"\\u12"', '"a"b"'])
def test_what_strict_json_refuses_is_refused(compiler: xgr.GrammarCompiler, text: str) -> None:
    assert not accepts(compiler, bounded(0, 4), text)


def test_utf8_encoded_surrogates_are_refused(compiler: xgr.GrammarCompiler) -> None:
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(
        json.dumps(bounded_strings_as_patterns(bounded(0, 4))), any_whitespace=False))
    assert not matcher.accept_string(b'"\xed\xa0\x80"')  # U+D800 as UTF-8: no Unicode decoder reads it
    assert accepts(compiler, bounded(0, 4), '"\ud7ff\ue000\U0010ffff"')


def test_bounds_are_rewritten_wherever_a_schema_can_hold_a_string(compiler: xgr.GrammarCompiler) -> None:
    short = bounded(max_length=2)
    schema = {
        "type": "object",
        "properties": {
            "list": {"type": "array", "items": short},
            "either": {"anyOf": [short, {"type": "integer"}]},
            "ref": {"$ref": "#/$defs/short"},
            "map": {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "integer"}},
            "nullable": {"type": ["string", "null"], "maxLength": 2},
        },
        "required": ["list", "either", "ref", "map", "nullable"],
        "$defs": {"short": short},
    }
    rewritten = json.dumps(bounded_strings_as_patterns(schema))
    assert "maxLength" not in rewritten
    good = {"list": ["\n", "ab"], "either": "\"", "ref": "a\t", "map": {"\\": 1}, "nullable": None}
    assert accepts(compiler, schema, json.dumps(good))
    for field, bad in [("list", ["abc"]), ("list", ["\x13"]), ("either", "abc"), ("ref", "\x01"),
                       ("map", {"abc": 1}), ("map", {"\x02": 1}), ("nullable", "\x03")]:
        text = raw_controls(json.dumps({**good, field: bad}))
        assert not accepts(compiler, schema, text), text


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 3, "pattern": "^a+$"},
    {"type": "string", "maxLength": 3, "enum": ["ab", "cd"]},
    {"type": "string", "maxLength": 3, "const": "ab"},
    {"type": "string", "maxLength": 30, "format": "email"},
    {"type": "integer", "maxLength": 3},
    {"maxLength": 3},
    {"type": "string", "minLength": 4, "maxLength": 3},
    {"type": "string", "maxLength": -1},
    {"type": "string", "maxLength": True},
    {"type": "string", "maxLength": 2.5},
    {"type": "object", "properties": {"maxLength": {"type": "integer"}, "enum": {"type": "string"}}},
    {"type": "string", "minLength": 0},
])
def test_what_the_rewrite_leaves_alone(schema: dict[str, Any]) -> None:
    expected = {key: value for key, value in schema.items()}
    if schema == {"type": "string", "minLength": 0}:
        expected = {"type": "string"}  # a bound of nothing is no bound
    assert bounded_strings_as_patterns(schema) == expected


def test_the_schema_given_is_not_modified() -> None:
    schema = {"type": "object", "properties": {"a": bounded(1, 2)}, "items": [bounded(0, 1)]}
    before = copy.deepcopy(schema)
    assert bounded_strings_as_patterns(schema) != before
    assert schema == before
