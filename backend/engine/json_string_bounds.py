"""Length-bounded JSON strings, rewritten so xgrammar keeps them valid JSON.

xgrammar (0.2.9) lowers ``minLength``/``maxLength`` to a bare character class that
admits raw control characters (U+0000-U+001F, which RFC 8259 forbids inside a string)
and no escapes at all (mlc-ai/xgrammar#800). A finished output can then fail a strict
``json.loads``. :func:`bounded_strings_as_patterns` rewrites each such bound into a
``pattern`` over the string's JSON text, one repetition per decoded character:

* a raw character other than ``"``, ``\\``, the control characters and the surrogates
  (xgrammar takes UTF-8-encoded surrogate bytes for one character; a decoder shows three
  U+FFFD, which would break the count);
* a two-character escape (``\\"``, ``\\\\``, ``\\/``, ``\\b``, ``\\f``, ``\\n``, ``\\r``, ``\\t``);
* ``\\uXXXX`` for a code point outside the surrogates, or a surrogate pair
  ``\\uD8xx\\uDCxx`` for one code point past U+FFFF (lone surrogates are refused);

so the length is still counted in characters of the decoded string, as JSON Schema
counts it. xgrammar matches a ``pattern`` against the JSON text between the quotes.
The character class carries a raw U+001F, which makes xgrammar expand the pattern into
its grammar (its regex-to-EBNF path) instead of its automaton path, whose JSON mode
would refuse every backslash and so every escape. Either path yields strict JSON.

Left as they are: a schema whose ``type`` does not name ``string`` (a ``propertyNames``
schema needs none), a string that also has ``pattern``, ``format``, ``enum`` or
``const`` (xgrammar already constrains those through other paths, and ignores the
length beside a pattern or format), and bounds that are not non-negative integers
with ``minLength <= maxLength`` (xgrammar reports those). Drop this rewrite once a
fixed xgrammar is pinned. Pure: the input schema is not modified.
"""
from __future__ import annotations

from typing import Any

_HEX = "[0-9a-fA-F]"
# The raw U+001F that ends the range is deliberate: see the module docstring.
_JSON_CHAR = (
    '(?:[^"\\\\\\x00-\x1f\\ud800-\\udfff]'
    '|\\\\["\\\\/bfnrt]'
    f"|\\\\u(?:[0-9a-cA-CefEF]{_HEX}{{3}}|[dD][0-7]{_HEX}{{2}})"
    f"|\\\\u[dD][89abAB]{_HEX}{{2}}\\\\u[dD][c-fC-F]{_HEX}{{2}})"
)
# Keywords whose value is one subschema, a list of subschemas, or a map from names to subschemas.
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
        "propertyNames", "contains", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Beside these xgrammar does not use the length bounds' character class, so there is nothing to rewrite.
_OTHER_STRING_CONSTRAINTS = ("pattern", "format", "enum", "const")


def json_string_pattern(min_length: int, max_length: int | None) -> str:
    """A ``pattern`` over a string's JSON text that holds ``min_length..max_length`` decoded characters."""
    upper = "" if max_length is None else str(max_length)
    return f"^{_JSON_CHAR}{{{min_length},{upper}}}$"


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with every rewritable ``minLength``/``maxLength`` turned into an equivalent ``pattern``."""
    return _rewrite(schema, names=False)


def _rewrite(schema: Any, names: bool) -> Any:
    """``names``: ``schema`` is a ``propertyNames`` schema, which only ever sees strings, typed or not."""
    if isinstance(schema, list):  # items given as a list (draft 4-7 tuples)
        return [_rewrite(item, names=False) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = dict(schema)
    for key in _ONE:
        if key in rewritten:
            rewritten[key] = _rewrite(rewritten[key], names=key == "propertyNames")
    for key in _LIST:
        if isinstance(rewritten.get(key), list):
            rewritten[key] = [_rewrite(item, names=names) for item in rewritten[key]]
    for key in _MAP:
        if isinstance(rewritten.get(key), dict):
            rewritten[key] = {name: _rewrite(item, names=False) for name, item in rewritten[key].items()}
    return _with_pattern(rewritten, names)


def _with_pattern(schema: dict[str, Any], names: bool) -> dict[str, Any]:
    if "minLength" not in schema and "maxLength" not in schema:
        return schema
    type_ = schema.get("type", "string" if names else None)
    if not _is_string_type(type_) or any(key in schema for key in _OTHER_STRING_CONSTRAINTS):
        return schema
    min_length, max_length = schema.get("minLength", 0), schema.get("maxLength")
    if not _is_count(min_length) or not (max_length is None or _is_count(max_length)):
        return schema
    if max_length is not None and min_length > max_length:
        return schema
    rewritten = {key: value for key, value in schema.items() if key not in ("minLength", "maxLength")}
    if min_length > 0 or max_length is not None:
        rewritten["pattern"] = json_string_pattern(min_length, max_length)
    return rewritten


def _is_string_type(type_: object) -> bool:
    return type_ == "string" or (isinstance(type_, list) and "string" in type_)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
