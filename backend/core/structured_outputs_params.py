"""What a request's output must match: vLLM's ``StructuredOutputsParams`` (exactly one constraint).

``json`` (a JSON schema, as a dict or as JSON text), ``regex``, ``choice`` (a list of
strings), ``grammar`` (EBNF as xgrammar reads it) or ``json_object=True`` (any JSON
object). The engine compiles the constraint with xgrammar off the step path
(:mod:`pagedllm.engine.grammar_compiler`); here only what is cheap to check is checked,
so a bad request is refused before it costs the engine anything:

* at most ``MAX_CONSTRAINT_CHARS`` (64 Ki) characters of constraint text, and JSON
  schemas nested at most ``MAX_SCHEMA_NESTING`` (128) brackets deep. xgrammar's compile
  time climbs steeply past these (measured on this project's CPU: a 14,000-string enum
  of 129 KB took 4.8 s, 20,000 strings 9.7 s and 100,000 strings 200 s; a schema nested
  1,000 objects deep took 232 s before compiling began), and a compile cannot be
  interrupted once started;
* a schema must be JSON text or a JSON object; a choice a non-empty list of strings.

What xgrammar itself refuses (an unsupported schema keyword, a regex or EBNF syntax
error) fails the request when it compiles, with xgrammar's reason. This module imports
neither torch nor xgrammar: the scheduler's requests carry it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_SCHEMA_NESTING = 128
_FIELD = "SamplingParams.structured_outputs"
# vLLM's older ``GuidedDecodingParams`` also names a backend; only xgrammar is here.
_BACKENDS = (None, "auto", "xgrammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one of the constraints; ``json`` is kept as JSON text (a dict given is serialized)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", _schema_text(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise ValueError(f"{_FIELD}.json_object={self.json_object!r} is invalid: must be true or false")
        if len(given) != 1:
            raise ValueError(f"{_FIELD} is invalid: give exactly one of json, regex, choice, grammar, json_object "
                             f"(got {given or 'none'})")
        self._check(given[0])

    def _check(self, kind: str) -> None:
        if kind == "json":
            _check_schema_text(self.json)
        elif kind == "choice":
            choice = self.choice
            if not isinstance(choice, tuple) or not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError(f"{_FIELD}.choice is invalid: must be a non-empty list of strings")
            _check_size("choice", sum(len(c) for c in choice))
        elif kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise ValueError(f"{_FIELD}.{kind} is invalid: must be a non-empty string")
            _check_size(kind, len(text))

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """The compile cache's key: the kind and the constraint's text."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, "" if kind == "json_object" else getattr(self, kind)

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """From an instance, a dict with vLLM's keys, or that dict as JSON text (a Triton parameter)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError) as error:
                raise ValueError(f"{_FIELD} is invalid: not a JSON object ({error})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"{_FIELD} is invalid: expected an object with one of json, regex, choice, grammar, "
                             f"json_object, got {type(value).__name__}")
        values = {key: item for key, item in value.items() if item is not None}
        backend = values.pop("backend", None)
        if backend not in _BACKENDS:
            raise ValueError(f"{_FIELD}.backend={backend!r} is invalid: only xgrammar is available")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(key) for key in set(values) - known)
        if unknown:
            raise ValueError(f"{_FIELD} has unknown key(s) {unknown}; allowed: {sorted(known)}")
        if isinstance(values.get("json_object"), str):
            values["json_object"] = values["json_object"].strip().lower() == "true"
        return cls(**values)


def _schema_text(schema: object) -> str:
    try:
        return json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"{_FIELD}.json is invalid: not JSON-serializable ({error})") from None


def _check_schema_text(text: object) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{_FIELD}.json is invalid: must be a JSON schema (an object or JSON text)")
    _check_size("json", len(text))
    depth = _nesting(text)
    if depth > MAX_SCHEMA_NESTING:
        raise ValueError(f"{_FIELD}.json is invalid: nested {depth} levels deep; at most {MAX_SCHEMA_NESTING}")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{_FIELD}.json is invalid: not valid JSON ({error})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{_FIELD}.json is invalid: a JSON schema is an object, got {type(schema).__name__}")


def _check_size(name: str, size: int) -> None:
    if size > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{_FIELD}.{name} is invalid: {size} characters; at most {MAX_CONSTRAINT_CHARS} "
                         "(compile time grows steeply with a constraint's size)")


def _nesting(text: str) -> int:
    """How deep ``[``/``{`` nest in JSON text, outside strings; one pass, no recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest
