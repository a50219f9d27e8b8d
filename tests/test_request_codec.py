"""Parsing vllm_backend-style Triton inputs into validated requests, without Triton."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.serving.triton.request_codec import INPUT_NAMES, ReturnFlags, parse_request, parse_sampling_parameters


def text(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


def test_minimal_request_uses_vllm_defaults() -> None:
    request = parse_request({"text_input": text("Hello")})
    assert request.prompt == "Hello"
    assert request.params == SamplingParams()
    assert not request.stream
    assert request.prepend_input  # non-streaming prepends the prompt unless excluded
    assert request.returns == ReturnFlags()


def test_streaming_excludes_the_prompt_by_default() -> None:
    request = parse_request({"text_input": text("Hi"), "stream": flag(True)})
    assert request.stream and not request.prepend_input


def test_exclude_input_in_output_controls_prepending() -> None:
    assert not parse_request({"text_input": text("Hi"), "exclude_input_in_output": flag(True)}).prepend_input
    assert parse_request({"text_input": text("Hi"), "exclude_input_in_output": flag(False)}).prepend_input
    stream_excluding = parse_request({"text_input": text("Hi"), "stream": flag(True),
                                      "exclude_input_in_output": flag(True)})
    assert not stream_excluding.prepend_input


def test_sampling_parameters_accept_numbers_sent_as_strings() -> None:
    sent = {"temperature": "0", "max_tokens": "7", "top_p": "0.5", "n": 2, "stop": ["x"], "ignore_eos": "true",
            "seed": None}
    request = parse_request({"text_input": text("Hi"), "sampling_parameters": text(json.dumps(sent))})
    assert request.params == SamplingParams(temperature=0.0, max_tokens=7, top_p=0.5, n=2, stop=("x",),
                                            ignore_eos=True)


def test_request_parameters_are_used_without_the_tensor() -> None:
    request = parse_request({"text_input": text("Hi")}, json.dumps({"max_tokens": 3, "temperature": 0}))
    assert request.params.max_tokens == 3 and request.params.greedy


def test_the_tensor_wins_over_request_parameters() -> None:
    request = parse_request({"text_input": text("Hi"), "sampling_parameters": text('{"max_tokens": 5}')},
                            json.dumps({"max_tokens": 3}))
    assert request.params.max_tokens == 5


def test_return_flags() -> None:
    inputs = {"text_input": text("Hi"), "return_finish_reason": flag(True), "return_num_output_tokens": flag(True),
              "return_logprobs": flag(False)}
    assert parse_request(inputs).returns == ReturnFlags(finish_reason=True, num_output_tokens=True)


def test_sparse_additional_outputs_is_off_unless_asked() -> None:
    assert not parse_request({"text_input": text("Hi")}).returns.sparse
    asked = parse_request({"text_input": text("Hi"), "sparse_additional_outputs": flag(True)})
    assert asked.returns.sparse and not asked.returns.finish_reason


def test_cumulative_logprob_alone_asks_the_engine_for_the_sampled_tokens_logprobs_only() -> None:
    inputs = {"text_input": text("Hi"), "return_cumulative_logprob": flag(True)}
    request = parse_request(inputs)
    assert request.params.logprobs == 0 and not request.logprobs_requested
    asked = parse_request({**inputs, "sampling_parameters": text('{"logprobs": 2}')})
    assert asked.params.logprobs == 2 and asked.logprobs_requested
    beams = parse_request({**inputs, "sampling_parameters": text('{"beam_width": 2, "temperature": 0}')})
    assert beams.params.logprobs is None  # beam search scores its own cumulative logprob
    assert parse_request({"text_input": text("Hi")}).params.logprobs is None


@pytest.mark.parametrize(
    ("inputs", "parameters", "field", "reason"),
    [
        ({}, None, "text_input", "missing"),
        ({"text_input": text("")}, None, "text_input", "empty"),
        ({"text_input": text(b"\xff\xfe")}, None, "text_input", "UTF-8"),
        ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None, "text_input", "exactly one element"),
        ({"text_input": text("a"), "stream": np.array([True, False])}, None, "stream", "exactly one element"),
        ({"text_input": text("a"), "sampling_parameters": text("{nope")}, None, "sampling_parameters",
         "not valid JSON"),
        ({"text_input": text("a"), "sampling_parameters": text("[1, 2]")}, None, "sampling_parameters",
         "JSON object"),
        ({"text_input": text("a"), "sampling_parameters": text('{"temprature": 1}')}, None, "temprature",
         "unknown"),
        ({"text_input": text("a"), "sampling_parameters": text('{"max_tokens": "many"}')}, None, "max_tokens",
         "wrong type"),
        ({"text_input": text("a"), "sampling_parameters": text('{"temperature": -0.5}')}, None, "temperature",
         ">= 0"),
        ({"text_input": text("a"), "sampling_parameters": text('{"top_p": 0}')}, None, "top_p", "(0, 1]"),
        ({"text_input": text("a"), "sampling_parameters": text('{"top_p": 1.5}')}, None, "top_p", "(0, 1]"),
        ({"text_input": text("a"), "sampling_parameters": text('{"max_tokens": 0}')}, None, "max_tokens", ">= 1"),
        ({"text_input": text("a"), "sampling_parameters": text('{"n": 0}')}, None, "n", ">= 1"),
        ({"text_input": text("a")}, '{"temperature": "hot"}', "temperature", "wrong type"),
        ({"text_input": text("a")}, "not json", "parameters", "not valid JSON"),
        ({"text_input": text("a"), "stream": flag(True), "exclude_input_in_output": flag(False)}, None,
         "exclude_input_in_output", "must be true"),
        ({"text_input": text("a"), "stream": np.array([7])}, None, "stream", "boolean"),
        ({"text_input": text("a"), "images": text("x")}, None, "images", "unknown input"),
    ],
)
def test_bad_input_names_the_field_and_the_reason(inputs, parameters, field, reason) -> None:
    with pytest.raises(ValueError) as error:
        parse_request(inputs, parameters)
    message = str(error.value)
    assert field in message and reason in message


def test_non_streaming_n_greater_than_one_with_the_prompt_is_well_defined() -> None:
    request = parse_request({"text_input": text("Hi"), "stream": flag(False), "exclude_input_in_output": flag(False),
                             "sampling_parameters": text('{"n": "3"}')})
    assert request.params.n == 3 and request.prepend_input and not request.stream


def test_every_declared_input_is_accepted() -> None:
    inputs = {name: flag(False) for name in INPUT_NAMES}
    inputs["text_input"] = text("Hi")
    inputs["sampling_parameters"] = text("{}")
    inputs["lora_name"] = text("")
    assert parse_request(inputs).prompt == "Hi"


def test_parse_sampling_parameters_prefixes_the_source() -> None:
    with pytest.raises(ValueError, match=r"^parameters: .*top_k"):
        parse_sampling_parameters('{"top_k": 0}', "parameters")


@pytest.mark.parametrize(
    ("sent", "stop"),
    [
        ("[INST]", ("[INST]",)),
        ("[1, 2]", ("[1, 2]",)),
        ("[", ("[",)),
        ('["[INST]", "</s>"]', ("[INST]", "</s>")),
        (["[INST]", "x"], ("[INST]", "x")),
        ("plain", ("plain",)),
    ],
)
def test_stop_is_any_string_or_a_list_of_strings(sent: object, stop: tuple[str, ...]) -> None:
    assert parse_sampling_parameters(json.dumps({"stop": sent}), "sampling_parameters").stop == stop


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        ('{"temperature": NaN}', "temperature", "finite"),
        ('{"top_p": "Infinity"}', "top_p", "finite"),
        ('{"min_p": -Infinity}', "min_p", "finite"),
        ('{"repetition_penalty": 1e400}', "repetition_penalty", "finite"),
        ('{"presence_penalty": "nan"}', "presence_penalty", "finite"),
        (json.dumps({"stop": ["s"] * 65}), "stop", "at most 64"),
        (json.dumps({"stop": ["y" * 1025]}), "stop", "at most 1024"),
        (json.dumps({"stop_token_ids": list(range(1025))}), "stop_token_ids", "at most 1024"),
        (json.dumps({"stop": [1, 2]}), "stop", "wrong type"),
        ('{"stop": ' + "[" * 10_000 + "]" * 10_000 + "}", "sampling_parameters", "nested too deeply"),
        ('{"n": true}', "n", "wrong type"),
        ('{"ignore_eos": 1}', "ignore_eos", "wrong type"),
        ('{"max_tokens": "7.5"}', "max_tokens", "wrong type"),
    ],
)
def test_non_finite_oversized_and_mistyped_values_name_the_field(text: str, field: str, reason: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_sampling_parameters(text, "sampling_parameters")
    assert field in str(error.value) and reason in str(error.value)


def test_a_prompt_longer_than_the_model_could_take_is_refused_before_tokenizing() -> None:
    assert parse_request({"text_input": text("x" * 100)}, max_prompt_bytes=100).prompt == "x" * 100
    with pytest.raises(ValueError, match=r"^text_input: 101 bytes .* \(at most 100 bytes\)"):
        parse_request({"text_input": text("x" * 101)}, max_prompt_bytes=100)


@pytest.mark.parametrize("temperature", [0.0, 1e-30, 9.9e-6])
def test_temperatures_below_1e_5_are_greedy(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"n": "3"}, "n"), ({"temperature": "0"}, "temperature"), ({"stop": [1]}, "stop[0]"),
     ({"ignore_eos": 1}, "ignore_eos"), ({"top_p": float("nan")}, "top_p"), ({"seed": 1.5}, "seed")],
)
def test_direct_construction_checks_types(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match="SamplingParams." + re.escape(field)):
        SamplingParams(**kwargs)
