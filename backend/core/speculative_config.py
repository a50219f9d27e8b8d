"""Speculative decoding settings, spelled as vLLM's ``speculative_config``.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``
turns on prompt-lookup speculation: each decoding sequence proposes up to ``k`` tokens copied from
its own earlier context, and the target model verifies them in the next step
(``pagedllm.engine.speculative``). As in vLLM, a missing ``prompt_lookup_min`` / ``prompt_lookup_max``
takes the other's value, and both default to 5 when neither is given.

``disable_by_batch_size`` (vLLM's name): a step with more running sequences than this proposes
nothing, because verifying drafts then costs compute that a large batch no longer has to spare.
``None`` keeps our measured default (``DEFAULT_DISABLE_BY_BATCH_SIZE``); ``0`` never disables.

``disable_by_acceptance_rate`` (per request; ``None``, the default, never disables): once a request
has had ``ACCEPTANCE_RATE_MIN_DRAFTS`` tokens drafted, it stops proposing for good when the share of
its drafted tokens accepted so far is below this rate, since each rejected draft costs a forward row
(and, with a draft model, a draft step) that buys nothing.

``draft_confidence_threshold`` (method ``draft_model`` only; ours, vLLM has none): a draft model stops
guessing further ahead for a sequence after a guess it gave less than this probability, since a
guess the draft itself doubts is likely rejected and every draft step after it would be wasted
(``num_speculative_tokens`` is then the most drafts per step). ``None`` keeps the measured default
(``DEFAULT_DRAFT_CONFIDENCE_THRESHOLD``); ``0`` always drafts ``k``.

``draft_dtype`` (method ``draft_model`` only; ours): the draft's compute dtype, one of ``DRAFT_DTYPES``.
``None`` or ``"auto"``: the target's, except that a float32 target on a CPU that computes bfloat16
natively (avx512_bf16 or AMX) runs its draft in bfloat16, whose weights stream at half the bytes. The
draft only proposes: the target's verification decides every token, so greedy output stays the
target's and rejection sampling reads the draft's own ``q``, whatever the draft's precision.

Torch-free, like the rest of the configuration.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
_DEFAULT_LOOKUP = 5
# The most drafted tokens a step may verify per sequence: beyond this the acceptance of a
# prompt-lookup run is tiny and each position still costs a forward row.
MAX_SPECULATIVE_TOKENS = 16
# Above this many running sequences a step decodes normally: half the batch size where n-gram speculation
# stopped paying on a CPU with the default model (pagedllm bench spec --disable-by-batch-size 0; RESULTS).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
# A draft model's guess below this probability (under the draft) ends its drafting for the step. Chosen on the
# default model and its shipped draft, where it cut more draft steps than accepted tokens (RESULTS, issue 41 on
# the AMX host, "Where a speculative step's time goes; draft steps cut by the draft's confidence").
DEFAULT_DRAFT_CONFIDENCE_THRESHOLD = 0.3
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Drafted tokens a request is measured over before its acceptance rate may turn its speculation off.
ACCEPTANCE_RATE_MIN_DRAFTS = 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # the draft checkpoint (method draft_model)
    disable_by_batch_size: int | None = None
    disable_by_acceptance_rate: float | None = None
    draft_confidence_threshold: float | None = None
    draft_dtype: str | None = None

    def __post_init__(self) -> None:
        _require(self.method in METHODS, "method", self.method, f"one of {', '.join(METHODS)}")
        _require(_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                 "num_speculative_tokens", self.num_speculative_tokens, f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = _DEFAULT_LOOKUP
        low, high = (high if low is None else low), (low if high is None else high)
        _require(_int(low) and low >= 1, "prompt_lookup_min", self.prompt_lookup_min, "an integer >= 1")
        _require(_int(high) and high >= low, "prompt_lookup_max", self.prompt_lookup_max,
                 f"an integer >= prompt_lookup_min ({low})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if self.method == "draft_model":  # unset: the draft shipped with the embedded default model
            _require(self.model is None or (isinstance(self.model, str) and bool(self.model)), "model", self.model,
                     "the draft checkpoint (a directory or hub id) with method draft_model")
        else:
            _require(self.model is None, "model", self.model, f"null with method {self.method!r}")
        _require(self.disable_by_batch_size is None or (_int(self.disable_by_batch_size)
                                                        and self.disable_by_batch_size >= 0),
                 "disable_by_batch_size", self.disable_by_batch_size, "null or an integer >= 0")
        rate = self.disable_by_acceptance_rate
        _require(rate is None or (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0.0 <= rate <= 1.0),
                 "disable_by_acceptance_rate", rate, "null or a number in [0, 1]")
        threshold = self.draft_confidence_threshold
        if self.method == "draft_model":
            _require(threshold is None or (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
                                           and 0.0 <= threshold <= 1.0),
                     "draft_confidence_threshold", threshold, "null or a number in [0, 1]")
        else:
            _require(threshold is None, "draft_confidence_threshold", threshold, f"null with method {self.method!r}")
        if self.method == "draft_model":
            _require(self.draft_dtype is None or self.draft_dtype in DRAFT_DTYPES, "draft_dtype", self.draft_dtype,
                     f"null or one of {', '.join(DRAFT_DTYPES)}")
        else:
            _require(self.draft_dtype is None, "draft_dtype", self.draft_dtype, f"null with method {self.method!r}")

    @property
    def max_batch_size(self) -> int | None:
        """The most running sequences a speculating step may have; None: no limit."""
        limit = DEFAULT_DISABLE_BY_BATCH_SIZE if self.disable_by_batch_size is None else self.disable_by_batch_size
        return None if limit == 0 else limit

    @property
    def confidence_threshold(self) -> float:
        """The draft probability below which a draft model's guess is its last for the step."""
        threshold = self.draft_confidence_threshold
        return DEFAULT_DRAFT_CONFIDENCE_THRESHOLD if threshold is None else float(threshold)

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a mapping or its JSON text (``--speculative-config``); unknown keys raise ``ValueError`` naming them."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON ({error})") from error
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; allowed: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config.{key} is required")
        return cls(**value)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{name}={value!r} is invalid: expected {rule}")
