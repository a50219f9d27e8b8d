"""Fuzz: JSON outputs with length-bounded strings are strict JSON, valid against their schema.

Random schemas put bounded strings (``minLength``/``maxLength``, also in ``propertyNames``)
inside objects, arrays, ``anyOf`` and ``$ref``, beside ``pattern``, ``enum`` and ``const``
siblings. A tiny random-weight model samples them at temperature 1; its byte-level
vocabulary has a token for every control byte and for quotes and backslashes, so a lax
grammar shows up as output that strict ``json.loads`` refuses (mlc-ai/xgrammar#800).
Every sample that ended with ``stop`` must parse strictly and validate; every ``length``
cut must be a prefix the production grammar accepts, token by token.

By default one batch of ``DEFAULT_SCHEMAS`` schemas (about 20 s); ``pytest --full``
runs ``FULL_SCHEMAS`` with more samples each.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

import full_run

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.engine.grammar_compiler import GrammarCompiler
from pagedllm.testing.tiny_model import make_tiny_model

FULL = full_run.full()
DEFAULT_SCHEMAS, FULL_SCHEMAS = 64, 400
SAMPLES = 4 if FULL else 2
MAX_TOKENS = 96


class SchemaFuzzer:
    """Small random schemas; every one has at least one length-bounded string."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.defs: dict[str, Any] = {}

    def schema(self) -> dict[str, Any]:
        root = self.obj(depth=0)
        root["properties"]["b"] = self.bounded()
        root["required"] = sorted(root["properties"])
        if self.defs:
            root["$defs"] = self.defs
        return root

    def bounded(self) -> dict[str, Any]:
        low = self.rng.choice([None, 0, 1, 2])
        high = self.rng.choice([None, 1, 2, 3, 5])
        if low is not None and high is not None and low > high:
            low, high = high, low
        if high is None and low in (None, 0):
            high = 4
        schema: dict[str, Any] = {"type": self.rng.choice(["string", "string", ["string", "null"]])}
        if low is not None:
            schema["minLength"] = low
        if high is not None:
            schema["maxLength"] = high
        return schema

    def sibling(self) -> dict[str, Any]:
        return self.rng.choice([
            {"type": "string", "pattern": "^[a-z]{1,3}$"},
            {"enum": ["x", "y\"z", "\\", "\t"]},
            {"const": "c\n\u00e9"},
            {"type": "integer", "minimum": -9, "maximum": 99},
            {"type": "boolean"},
        ])

    def value(self, depth: int) -> dict[str, Any]:
        choices = ["bounded", "bounded", "sibling", "anyOf", "ref"] + (["obj", "array", "names"] if depth < 2 else [])
        kind = self.rng.choice(choices)
        if kind == "bounded":
            return self.bounded()
        if kind == "sibling":
            return self.sibling()
        if kind == "anyOf":
            return {"anyOf": [self.bounded(), self.sibling()]}
        if kind == "ref":
            name = f"d{len(self.defs)}"
            self.defs[name] = self.bounded()
            return {"$ref": f"#/$defs/{name}"}
        if kind == "array":
            return {"type": "array", "items": self.value(depth + 1), "maxItems": self.rng.choice([1, 2, 3])}
        if kind == "names":
            return {"type": "object", "propertyNames": {"minLength": 1, "maxLength": self.rng.choice([1, 2, 3])},
                    "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}, "maxProperties": 2}
        return self.obj(depth + 1)

    def obj(self, depth: int) -> dict[str, Any]:
        count = self.rng.randint(1, 3 if depth == 0 else 2)
        properties = {f"p{i}": self.value(depth) for i in range(count)}
        return {"type": "object", "properties": properties, "required": sorted(properties),
                "additionalProperties": False}


def fuzz_schemas(count: int) -> list[dict[str, Any]]:
    return [SchemaFuzzer(seed).schema() for seed in range(count)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model: Path = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-strict-json"), arch="qwen2")
    return LLM(str(model), max_num_seqs=128, max_model_len=512)


def test_the_vocabulary_can_write_what_strict_json_forbids(llm: LLM) -> None:
    decoded = {llm.tokenizer.decode([token]) for token in range(len(llm.tokenizer))}
    for text in ["\x00", "\x13", "\x1f", "\"", "\\"]:
        assert text in decoded, repr(text)


def test_fuzzed_bounded_strings_are_strict_json_and_valid(llm: LLM) -> None:
    schemas = fuzz_schemas(FULL_SCHEMAS if FULL else DEFAULT_SCHEMAS)
    params = [SamplingParams(n=SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0, seed=index,
                             structured_outputs={"json": schema}) for index, schema in enumerate(schemas)]
    outputs = llm.generate([f"Record {index}:" for index in range(len(schemas))], params)
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model.vocab_size, llm.engine.eos_token_ids)
    finished = cut = 0
    try:
        for schema, output in zip(schemas, outputs, strict=True):
            grammar = compiler.submit(StructuredOutputsParams(json=schema)).result(timeout=120)
            for sample in output.outputs:
                if sample.finish_reason == "stop":
                    finished += 1
                    value = json.loads(sample.text)  # strict: no raw control characters
                    jsonschema.validate(value, schema)
                else:
                    assert sample.finish_reason == "length", sample.finish_reason
                    cut += 1
                    matcher = xgr.GrammarMatcher(grammar)
                    assert all(matcher.accept_token(token) for token in sample.token_ids), (schema, sample.text)
                    assert not matcher.is_terminated()
    finally:
        compiler.close()
    print(f"{len(schemas)} schemas: {finished} samples ended with stop, {cut} cut at max_tokens")
    # The check is only as good as the samples that finished: most of them must.
    assert finished >= len(schemas) * SAMPLES // 2, (finished, cut)
