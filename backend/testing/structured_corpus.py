"""Constraints that the structured-output tests and ``pagedllm bench structured`` share.

JSON schemas covering what applications send (nested objects, arrays with min/max
items, enums, ``const``, string patterns and lengths, bounded integers and numbers,
``anyOf``/``oneOf``, ``$defs``/``$ref``, ``additionalProperties: false``, required and
optional keys), regexes, choice lists and an arithmetic-expression EBNF grammar.
"""
from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_AGE = {"type": "integer", "minimum": 0, "maximum": 130}

JSON_SCHEMAS: tuple[dict[str, Any], ...] = (
    {"type": "object", "properties": {"name": _NAME}, "required": ["name"]},
    {"type": "object", "properties": {"name": _NAME, "age": _AGE}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}, "w": {"const": 3}}, "required": ["v", "w"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["code"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"pts": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}, "minItems": 2, "maxItems": 2}},
     "required": ["pts"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": _NAME, "age": _AGE},
                                               "required": ["name", "age"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                                       {"type": "string", "maxLength": 6}]}}, "required": ["id"]},
    {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]}}, "required": ["shape"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"], "additionalProperties": False},
    {"type": "object", "properties": {"name": _NAME, "nick": _NAME}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": {"type": "string", "maxLength": 8}},
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "number", "minimum": -1, "maximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
    {"type": "string", "minLength": 3, "maxLength": 3},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"enum": [200, 404, 500]}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 1}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
     "required": ["value"]},
    {"$defs": {"leaf": {"type": "object", "properties": {"v": {"enum": [1, 2, 3]}}, "required": ["v"],
                        "additionalProperties": False}},
     "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"},
                                      "right": {"anyOf": [{"$ref": "#/$defs/leaf"}, {"type": "null"}]}},
     "required": ["left", "right"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}},
     "required": ["email"]},
)

REGEXES: tuple[str, ...] = (
    r"[a-z]{3}-\d{2}",
    r"\d{3}-\d{4}",
    r"(yes|no)",
    r"[A-Z][a-z]{2,6}",
    r"0x[0-9a-f]{4}",
    r"\d+\.\d{2}",
    r"(true|false)",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"#[0-9A-F]{6}",
    r"[01]{8}",
    r"(ab)+c",
    r"v\d\.\d\.\d",
    r"[A-Z]{2}\d{4}",
    r"(cat|dog|bird)s?",
    r"\d{4}-\d{2}-\d{2}",
    r"[a-z]{1,4}( [a-z]{1,4}){0,2}",
    r"-?\d{1,3}",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"[aeiou]{2,5}",
    r"(GET|POST) /[a-z]{1,5}",
    r"x{2,4}y?z",
)

CHOICES: tuple[tuple[str, ...], ...] = (
    ("positive", "negative", "neutral"),
    ("A", "B", "C", "D"),
    ("yes", "no"),
    ("Paris", "London", "New York", "Tokyo"),
)

# Parentheses nest at most twice, so a noisy model cannot write an expression without end.
ARITHMETIC_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" inner ")"
inner ::= iterm (("+" | "-") iterm){0,2}
iterm ::= ifactor (("*" | "/") ifactor){0,2}
ifactor ::= number | "(" number (("+" | "-") number){0,2} ")"
number ::= [0-9] | [1-9] [0-9]
"""
