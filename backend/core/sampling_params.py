"""User-facing sampling parameters (vLLM-compatible names), validated on construction.

Every problem raises ``ValueError`` naming the field. Limits this file sets itself
(the engine adds the ones that depend on the model: vocabulary, ``max_model_len``,
``max_num_seqs``, the KV pool, ``MAX_LOGPROBS``):

* float fields must be finite: ``NaN`` and ``Infinity`` are rejected;
* ``temperature`` below ``GREEDY_TEMPERATURE`` (1e-5) samples greedily, as in vLLM:
  dividing logits by a temperature that small overflows and yields NaN probabilities;
* ``stop`` holds at most ``MAX_STOP_STRINGS`` (64) strings of at most
  ``MAX_STOP_STRING_CHARS`` (1024) characters each, and ``stop_token_ids`` at most
  ``MAX_STOP_TOKEN_IDS`` (1024) ids: every stop is checked after every token, so an
  unbounded list would let one request slow every step;
* beam search (``beam_width`` > 1) is deterministic and scores raw log-probabilities,
  so it takes ``temperature`` 0 and refuses what would change either (sampling
  filters, penalties, seeds, ``min_tokens``), stop strings (text; use
  ``stop_token_ids``) and per-token logprobs; ``n`` must not exceed ``beam_width``;
  ``length_penalty`` and ``early_stopping`` apply only to beam search;
* ``structured_outputs`` (:class:`StructuredOutputsParams`, or a dict with its keys)
  constrains each sample to a JSON schema, regex, choice list, EBNF grammar or any JSON
  object; beam search refuses it. ``max_tokens`` still cuts a sample short (reason
  ``length``), which can leave its JSON incomplete.

To add a field, declare it with its type and default; ``from_dict`` and the type
checks follow the annotation, and range rules go in ``_validate``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.core.structured_outputs_params import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    ``temperature`` below 1e-5 (0 included) means greedy. ``top_k == -1`` and
    ``top_p == 1`` and ``min_p == 0`` disable those filters. ``seed`` makes a
    request's samples independent of whatever else shares its batch.
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
    # Per prompt token after the first: its logprob and the top ``prompt_logprobs`` (vLLM's name and shape);
    # such a request computes its whole prompt, without prefix-cache hits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Beam search (off at width 1): transformers' ``num_beams``, ``length_penalty`` and
    # ``early_stopping`` (True, False or "never"); ``n`` picks how many hypotheses come back.
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Seconds the request may take from arrival; the engine loop aborts it once they pass.
    timeout: float | None = None
    # The output must match this constraint (xgrammar, pagedllm.engine.grammar_compiler).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_value(self.structured_outputs))
        for name, hint in _field_types().items():
            object.__setattr__(self, name, _checked_type(name, hint, getattr(self, name)))
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
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", self.prompt_logprobs,
               "must be >= 0")
        _check(self.timeout is None or self.timeout > 0, "timeout", self.timeout, "must be > 0 (seconds)")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"<{len(self.stop)} strings>",
               f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(s for s in self.stop), "stop", self.stop, "must not contain empty strings")
        longest = max((len(s) for s in self.stop), default=0)
        _check(longest <= MAX_STOP_STRING_CHARS, "stop", f"<a {longest}-character string>",
               f"each stop string has at most {MAX_STOP_STRING_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"<{len(self.stop_token_ids)} ids>", f"at most {MAX_STOP_TOKEN_IDS} ids")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "must be >= 0")
        self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """Beam search is deterministic and scores raw log-probabilities: what would change either is refused."""
        _check(self.beam_width >= 1, "beam_width", self.beam_width, "must be >= 1 (1 turns beam search off)")
        _check(self.early_stopping in (True, False, "never"), "early_stopping", self.early_stopping,
               'must be true, false or "never"')
        if not self.use_beam_search:
            _check(self.length_penalty == 1.0, "length_penalty", self.length_penalty,
                   "applies only with beam_width > 1")
            _check(self.early_stopping is False, "early_stopping", self.early_stopping,
                   "applies only with beam_width > 1")
            return
        rule = f"does not apply to beam search (beam_width={self.beam_width})"
        _check(self.n <= self.beam_width, "n", self.n, f"must be <= beam_width ({self.beam_width})")
        _check(self.greedy, "temperature", self.temperature,
               f"must be 0 with beam_width={self.beam_width}: beam search is deterministic")
        _check(self.top_p == 1.0, "top_p", self.top_p, rule)
        _check(self.top_k == -1, "top_k", self.top_k, rule)
        _check(self.min_p == 0.0, "min_p", self.min_p, rule)
        _check(self.repetition_penalty == 1.0, "repetition_penalty", self.repetition_penalty, rule)
        _check(self.presence_penalty == 0.0, "presence_penalty", self.presence_penalty, rule)
        _check(self.frequency_penalty == 0.0, "frequency_penalty", self.frequency_penalty, rule)
        _check(self.seed is None, "seed", self.seed, rule)
        _check(self.min_tokens == 0, "min_tokens", self.min_tokens, rule)
        _check(not self.stop, "stop", self.stop, f"{rule}: stop strings are text; use stop_token_ids")
        _check(self.logprobs is None, "logprobs", self.logprobs, f"{rule}: use cumulative_logprob")
        _check(self.structured_outputs is None, "structured_outputs", self.structured_outputs,
               f"{rule}: constrain samples (beam_width=1) instead")

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from JSON-like values, accepting numbers and booleans sent as strings.

        Raises ``ValueError`` naming the field for unknown keys and bad types.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {sorted(known)}")
        hints = _field_types()
        return cls(**{name: _coerce(name, hints[name], value) for name, value in values.items()})


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(SamplingParams)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={_shown(value)} is invalid: {rule}")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _options(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _checked_type(name: str, hint: Any, value: Any) -> Any:
    """``value`` if it has the field's declared type (ints widen to float, lists to tuples), else raise."""
    options = _options(hint)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"SamplingParams.{name} must not be None")
    for kind in (o for o in options if o is not type(None)):
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not _finite(value):
                raise ValueError(f"SamplingParams.{name}={_shown(value)} is invalid: must be a finite number")
            return float(value)
        if typing.get_origin(kind) is tuple and isinstance(value, (list, tuple)):
            (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
            return tuple(_checked_type(f"{name}[{i}]", item, v) for i, v in enumerate(value))
        if kind is str and isinstance(value, str):
            return value
        if kind is StructuredOutputsParams and isinstance(value, kind):
            return value
    expected = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ValueError(f"SamplingParams.{name}={_shown(value)} has the wrong type: expected {expected}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Convert one JSON value to the field's declared type, or raise naming the field."""
    options = _options(hint)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"SamplingParams.{name} must not be null")
    if StructuredOutputsParams in options:  # its own messages name the field and the key at fault
        return StructuredOutputsParams.from_value(value)
    errors = []
    for option in (o for o in options if o is not type(None)):
        try:
            return _coerce_to(option, value)
        except (TypeError, ValueError, OverflowError) as error:
            errors.append(str(error))
    raise ValueError(f"SamplingParams.{name}={_shown(value)} has the wrong type: {'; '.join(errors)}")


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
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
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
        items = _list_from_text(value, item) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise TypeError("expected a list")
        return tuple(_coerce_to(item, v) for v in items)
    if kind is str:
        if isinstance(value, str):
            return value
        raise TypeError("expected a string")
    raise TypeError(f"unsupported field type {kind}")


def _list_from_text(text: str, item: Any) -> list[Any]:
    """A list sent as JSON text (as genai-perf does), else the text as the list's one element.

    For strings the text counts as a list only when it parses as a JSON list of
    strings, so any stop string (``"[INST]"``, ``"[1, 2]"``) can be sent as itself.
    """
    if not text.lstrip().startswith("["):
        return [text]
    try:
        parsed = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        if item is str:
            return [text]
        raise ValueError(f"not a JSON list ({error})") from None
    if item is str and not (isinstance(parsed, list) and all(isinstance(v, str) for v in parsed)):
        return [text]
    return parsed if isinstance(parsed, list) else [text]
