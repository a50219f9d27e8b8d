"""Structured outputs in the engine: every constrained output is valid, whatever else shares the batch.

A tiny random-weight model writes noise when unconstrained, so each valid output is the
constraint's doing. The checkpoint has more embedding rows (2100) than its tokenizer has
tokens (2048): the padding rows must never be sampled. The whole corpus runs in one batch
(fast); ``pytest --full`` also runs every constraint with ``n = 4`` and under
preemption (by default a few of each).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import full_run

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.engine.outputs import FinalOutput
from pagedllm.testing.structured_corpus import ARITHMETIC_EBNF, CHOICES, JSON_SCHEMAS, REGEXES
from pagedllm.testing.tiny_model import make_tiny_model

FULL = full_run.full()
TOKENIZER_TOKENS = 2048
EMBEDDING_ROWS = 2100
MAX_TOKENS = 150
# Long enough to fill KV blocks, so a repeated prompt hits the prefix cache.
PREAMBLE = "You are a careful assistant. Answer in the format you are given, and nothing else. " * 3

CONSTRAINTS: list[dict[str, Any]] = (
    [{"json": schema} for schema in JSON_SCHEMAS] + [{"regex": regex} for regex in REGEXES]
    + [{"choice": list(choice)} for choice in CHOICES] + [{"grammar": ARITHMETIC_EBNF}]
)


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-padded"), arch="qwen2",
                           overrides={"vocab_size": EMBEDDING_ROWS})


@pytest.fixture(scope="module")
def llm(padded_model: Path) -> LLM:
    return LLM(str(padded_model), dtype="float32", max_num_seqs=128, max_model_len=512)


def params_for(index: int, constraint: dict[str, Any], n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=MAX_TOKENS, temperature=1.0, seed=index, structured_outputs=constraint)


def as_xgrammar_reads(text: str) -> str:
    """xgrammar takes a UTF-8-encoded surrogate (ED A0..BF xx) for one character; Python's decoder shows its
    three bytes as three U+FFFD (README)."""
    return text.replace("\ufffd" * 3, "\ufffd")


def assert_valid(constraint: dict[str, Any], text: str) -> None:
    # Strict JSON: bounded strings are rewritten so they hold no raw control character (README).
    kind, value = next(iter(constraint.items()))
    if kind == "json":
        jsonschema.validate(json.loads(as_xgrammar_reads(text)), value)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(value, text), (value, text)
    elif kind == "choice":
        assert text in value, (value, text)
    else:
        assert ArithmeticParser(text).parse(), text


class ArithmeticParser:
    """The arithmetic EBNF's language: numbers of one or two digits, + - * /, parentheses."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def parse(self) -> bool:
        return self._expr() and self.at == len(self.text)

    def _expr(self) -> bool:
        if not self._term():
            return False
        while self._eat("+-"):
            if not self._term():
                return False
        return True

    def _term(self) -> bool:
        if not self._factor():
            return False
        while self._eat("*/"):
            if not self._factor():
                return False
        return True

    def _factor(self) -> bool:
        if self._eat("("):
            return self._expr() and self._eat(")")
        match = re.compile(r"[1-9][0-9]|[0-9]").match(self.text, self.at)
        if match is None:
            return False
        self.at = match.end()
        return True

    def _eat(self, chars: str) -> bool:
        if self.at < len(self.text) and self.text[self.at] in chars:
            self.at += 1
            return True
        return False


def run_corpus(llm: LLM, constraints: list[dict[str, Any]], n: int = 1, preamble: str = PREAMBLE) -> list[FinalOutput]:
    outputs = llm.generate([f"{preamble} request {i}: answer" for i in range(len(constraints))],
                           [params_for(i, c, n) for i, c in enumerate(constraints)])
    for constraint, output in zip(constraints, outputs):
        assert len(output.outputs) == n
        for sample in output.outputs:
            assert sample.finish_reason == "stop", (constraint, sample.text)
            assert all(token < TOKENIZER_TOKENS for token in sample.token_ids)
            assert_valid(constraint, sample.text)
    return outputs


def texts(outputs: list[FinalOutput]) -> list[list[str]]:
    return [[sample.text for sample in output.outputs] for output in outputs]


def test_corpus_is_large_enough() -> None:
    assert len(JSON_SCHEMAS) >= 30 and len(REGEXES) >= 20


def test_every_output_is_valid_and_prefix_hits_give_the_same(llm: LLM) -> None:
    first = run_corpus(llm, CONSTRAINTS)
    hits = llm.stats().prefix_cache_hit_tokens
    again = run_corpus(llm, CONSTRAINTS)  # the same prompts: their blocks come from the prefix cache
    assert llm.stats().prefix_cache_hit_tokens > hits
    assert texts(again) == texts(first)


def test_n_samples_each_follow_the_constraint(llm: LLM) -> None:
    chosen = CONSTRAINTS if FULL else [CONSTRAINTS[i] for i in (1, 11, 15, len(JSON_SCHEMAS), len(CONSTRAINTS) - 1)]
    outputs = run_corpus(llm, chosen, n=4)
    assert any(len(set(sample)) > 1 for sample in texts(outputs))  # the samples are not copies of each other


def test_preempted_samples_keep_their_matcher(padded_model: Path, llm: LLM) -> None:
    chosen = CONSTRAINTS if FULL else CONSTRAINTS[:12]
    roomy = run_corpus(llm, chosen, preamble="")
    # Room for one request at its longest (41 blocks of 4 tokens), not for all of them at once.
    tight = LLM(str(padded_model), dtype="float32", max_num_seqs=16, max_model_len=512, num_kv_blocks=42, block_size=4)
    outputs = run_corpus(tight, chosen, preamble="")
    assert tight.stats().num_preemptions > 0
    assert texts(outputs) == texts(roomy)


def test_unconstrained_requests_keep_their_tokens_in_a_mixed_batch(llm: LLM) -> None:
    plain = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.8, seed=7),
             SamplingParams(max_tokens=24, temperature=1.0, seed=8, n=2, top_k=50, repetition_penalty=1.2)]
    prompts = ["plain one", "plain two", "plain three"]
    alone = llm.generate(prompts, plain)
    constrained = [params_for(i, c) for i, c in enumerate(CONSTRAINTS[:8])]
    mixed = llm.generate(prompts + [f"c{i}" for i in range(8)], plain + constrained)
    assert texts(mixed[:3]) == texts(alone)
    assert [[s.token_ids for s in o.outputs] for o in mixed[:3]] == [[s.token_ids for s in o.outputs] for o in alone]
    for constraint, output in zip(CONSTRAINTS[:8], mixed[3:]):
        assert_valid(constraint, output.outputs[0].text)


def test_max_tokens_cuts_the_output_with_reason_length(llm: LLM) -> None:
    (output,) = llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0.0,
                                                   structured_outputs={"json": JSON_SCHEMAS[11]}))
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 3
    assert output.outputs[0].text.startswith("{")


def test_choice_and_its_older_spelling_through_a_dict(llm: LLM) -> None:
    """The params object, a plain dict, and vLLM's older ``guided_decoding`` object (with its ``backend``) in
    Triton's ``sampling_parameters`` JSON are one constraint, with one output."""
    from pagedllm.serving.triton.request_codec import parse_sampling_parameters

    choices = ("alpha", "beta")
    spellings = [
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"choice": list(choices)}),
        parse_sampling_parameters(json.dumps({"temperature": 0, "max_tokens": 20, "guided_decoding": {
            "choice": list(choices), "backend": "xgrammar"}}), "sampling_parameters"),
    ]
    assert len({params.structured_outputs for params in spellings}) == 1
    texts = [output.outputs[0].text for output in llm.generate(["pick"] * len(spellings), spellings)]
    assert texts[0] in choices and texts == [texts[0]] * len(spellings)


@pytest.mark.parametrize("values, message", [
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "colour": 1}, "unknown key"),
    ({"json": "not json"}, "not valid JSON"),
])
def test_bad_constraints_are_refused_naming_the_field(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        SamplingParams(structured_outputs=values)
    assert "structured_outputs" in str(error.value)


def test_beam_search_with_a_constraint_is_refused() -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(beam_width=2, temperature=0.0, structured_outputs={"regex": "a+"})


def test_eos_only_where_the_grammar_may_end(llm: LLM) -> None:
    # "ab+" may end after any b: the sample ends with EOS (reason stop) and its text still matches.
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs={"regex": "ab{1,20}"})
              for s in range(6)]
    for output in llm.generate(["go"] * 6, params):
        sample = output.outputs[0]
        assert sample.finish_reason == "stop" and re.fullmatch("ab{1,20}", sample.text)
        assert sample.token_ids[-1] in llm.engine.eos_token_ids


def test_json_object_outputs_are_objects(llm: LLM) -> None:
    # json_object bounds nothing, and a noisy model may write one key until max_tokens: those samples end with
    # "length" and hold the start of an object; every sample the grammar ended is a whole object.
    params = [SamplingParams(max_tokens=120, temperature=t, seed=s, structured_outputs={"json_object": True})
              for s in range(8) for t in (0.0, 1.0)]
    outputs = llm.generate([f"object {i}" for i in range(len(params))], params)
    ended = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert ended
    for text in ended:
        assert isinstance(json.loads(text), dict), text
    for output in outputs:
        assert output.outputs[0].text.startswith("{")
