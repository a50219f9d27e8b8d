"""User-facing sampling parameters (vLLM-compatible names), validated on construction."""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    ``temperature == 0`` means greedy. ``top_k == -1`` and ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``seed`` makes a request's samples
    independent of whatever else shares its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = _DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 (disabled) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})",
        )
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs, "must be >= 0")
        _check(all(s for s in self.stop), "stop", self.stop, "must not contain empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from JSON-like values, accepting numbers and booleans sent as strings.

        Raises ``ValueError`` naming the field for unknown keys and bad types.
        """
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {sorted(known)}")
        hints = typing.get_type_hints(cls)
        return cls(**{name: _coerce(name, hints[name], value) for name, value in values.items()})


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Convert one JSON value to the field's declared type, or raise naming the field."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"SamplingParams.{name} must not be null")
    errors = []
    for option in (o for o in options if o is not type(None)):
        try:
            return _coerce_to(option, value)
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    raise ValueError(f"SamplingParams.{name}={value!r} has the wrong type: {'; '.join(errors)}")


def _coerce_to(kind: Any, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise TypeError("expected a boolean")
    if kind is int:
        if isinstance(value, bool):
            raise TypeError("expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return int(value.strip())
        raise TypeError("expected an integer")
    if kind is float:
        if isinstance(value, bool):
            raise TypeError("expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())
        raise TypeError("expected a number")
    if typing.get_origin(kind) is tuple:
        (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
        if isinstance(value, str):
            parsed = json.loads(value) if value.strip().startswith("[") else [value]
        else:
            parsed = value
        if not isinstance(parsed, (list, tuple)):
            raise TypeError("expected a list")
        return tuple(_coerce_to(item, v) for v in parsed)
    if kind is str:
        if isinstance(value, str):
            return value
        raise TypeError("expected a string")
    raise TypeError(f"unsupported field type {kind}")
