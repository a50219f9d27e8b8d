"""Fuzz the request codec and the engine with generated ``sampling_parameters``, in process.

Every generated request either fails at submission with ``ValueError`` (in the codec or
in ``LLMEngine.add_request``) or completes; ``step()`` never raises and never ends a
request with an error; afterwards every KV block is free.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.serving.triton.request_codec import parse_request

MAX_STEPS = 2000

JSON_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=2),
    max_leaves=6,
)
NUMERIC_TEXT = st.sampled_from(["0", "1", "-1", "0.5", "1e-30", "NaN", "Infinity", "-inf", " 2 ", "1_0", "0x10", ""])
SMALL_FLOAT = st.floats(-3, 3) | st.sampled_from([0.0, 1e-30, 1e-6, 1e-5, 1e30, float("nan"), float("inf")])
TEXT = st.text(max_size=6) | st.sampled_from(["[INST]", '["a", "b"]', "[1, 2]", "[", "\n", "def"])

# Plausible values per field (mixed with anything JSON below); fields without an entry get anything.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(-2, 10),
    "temperature": SMALL_FLOAT,
    "top_p": SMALL_FLOAT,
    "top_k": st.integers(-3, 3000),
    "min_p": SMALL_FLOAT,
    "repetition_penalty": st.floats(0, 5) | st.sampled_from([1e-30, 1e30]),
    "presence_penalty": SMALL_FLOAT,
    "frequency_penalty": SMALL_FLOAT,
    "seed": st.integers(-(2**70), 2**70),
    "max_tokens": st.integers(-2, 40),
    "min_tokens": st.integers(-2, 40),
    "stop": TEXT | st.lists(TEXT, max_size=4),
    "stop_token_ids": st.lists(st.integers(-5, 5000), max_size=4),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(-2, 30),
    "skip_special_tokens": st.booleans(),
    "beam_width": st.integers(0, 4),
    "length_penalty": SMALL_FLOAT,
    "early_stopping": st.sampled_from([True, False, "never", "always"]),
}
# Values inside each field's own rules, so combinations reach the engine and run.
VALID: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, 4),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-30, 1e-5]),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(1, 3000) | st.just(-1),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.01, 3) | st.sampled_from([1e-30, 1e30]),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**64),
    "max_tokens": st.integers(1, 12),
    "min_tokens": st.integers(0, 4),
    "stop": st.lists(TEXT.filter(bool), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 2047), max_size=3),
    "logprobs": st.integers(0, 20),
    "beam_width": st.integers(1, 3),
    "length_penalty": st.floats(-2, 2),
}
KNOWN_KEYS = [f.name for f in dataclasses.fields(SamplingParams)]
UNKNOWN_KEYS = ["temprature", "best_of", "use_beam_search", "", "N", "max_new_tokens"]


@st.composite
def sampling_parameters(draw: st.DrawFn) -> str:
    keys = draw(st.lists(st.sampled_from(KNOWN_KEYS), max_size=6, unique=True))
    if draw(st.integers(0, 9)) == 0:
        keys.append(draw(st.sampled_from(UNKNOWN_KEYS)))
    values = {}
    if draw(st.booleans()):  # every value within its field's rules
        return json.dumps({key: draw(VALID.get(key, PLAUSIBLE.get(key, JSON_ANY))) for key in keys})
    for key in keys:
        plausible = PLAUSIBLE.get(key, JSON_ANY)
        kind = draw(st.integers(0, 9))  # mostly plausible values, sometimes as text, sometimes anything
        source = plausible if kind < 7 else plausible.map(str) if kind == 7 else JSON_ANY if kind == 8 else NUMERIC_TEXT
        values[key] = draw(source)
    if draw(st.booleans()):  # keep most requests short, so the engine really runs them
        values.setdefault("max_tokens", draw(st.integers(1, 12)))
    return json.dumps(values)  # NaN and Infinity become JSON's non-standard literals, as clients send them


@st.composite
def requests(draw: st.DrawFn) -> list[tuple[bytes, str]]:
    prompts = st.sampled_from([b"def f(x):", b"import os", b"", b"\xff\xfe", "été".encode(), b"x" * 300]) | \
        st.text(max_size=20).map(str.encode)
    return draw(st.lists(st.tuples(prompts, sampling_parameters()), min_size=1, max_size=3))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[[str], Path]) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", device="cpu",
                                  num_kv_blocks=48, max_model_len=128, max_num_seqs=8))


@pytest.mark.slow
def test_every_request_fails_at_submission_or_completes(engine: LLMEngine) -> None:
    reached = {"refused": 0, "completed": 0, "tokens": 0}

    @settings(max_examples=80, deadline=None, database=None, derandomize=True)
    @given(batch=requests())
    def run(batch: list[tuple[bytes, str]]) -> None:
        admitted: dict[str, bool] = {}
        for index, (prompt, parameters) in enumerate(batch):
            inputs = {"text_input": np.array([prompt], dtype=np.object_),
                      "sampling_parameters": np.array([parameters.encode()], dtype=np.object_)}
            try:
                request = parse_request(inputs)
                engine.add_request(f"r{index}", request.prompt, request.params)
            except ValueError:
                reached["refused"] += 1
                continue
            admitted[f"r{index}"] = False
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            for output in engine.step():
                assert output.error is None, f"{output.request_id} ended with {output.error!r}: {batch}"
                reached["tokens"] += sum(len(sample.token_ids) for sample in output.outputs)
                if output.finished:
                    admitted[output.request_id] = True
        assert not engine.has_unfinished_requests(), f"requests did not finish in {MAX_STEPS} steps: {batch}"
        assert all(admitted.values()), batch
        reached["completed"] += len(admitted)
        stats = engine.stats()
        assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0

    run()
    print(f"\nfuzzed requests: {reached}")
    # Both sides of the claim were exercised: requests the engine ran to the end, and requests refused.
    assert reached["completed"] >= 20 and reached["tokens"] > 0 and reached["refused"] > 0, reached
