"""Turn one Triton request's tensors and parameters into a validated generate request.

Same tensor names and meanings as Triton's vLLM backend, so its clients (genai-perf
``--backend vllm``, the HTTP generate endpoints, Triton's OpenAI frontend) work
unchanged. Works on plain numpy arrays so it is testable without Triton; every
problem raises ``ValueError`` whose message starts with the offending field.

Decisions where vllm_backend is loose:

* sampling parameters come from the ``sampling_parameters`` tensor when present,
  otherwise from the request parameters (the HTTP generate endpoint puts unknown
  JSON keys there); they are never merged. ``null`` values mean "use the default",
  as in vllm_backend; unknown keys are errors.
* the prompt's UTF-8 size is capped by ``max_prompt_bytes`` (the model passes
  ``max_model_len * MAX_PROMPT_BYTES_PER_TOKEN``): no tokenizer packs more than that many
  bytes into a token on real text, and rejecting a huge prompt here spares the engine
  thread from tokenizing megabytes before it can say the prompt is too long.
* ``exclude_input_in_output`` defaults to False without streaming (the prompt is
  prepended) and to True with streaming; asking for the prompt in a stream is an
  error, as in vllm_backend. Without streaming and ``n > 1`` every one of the n
  strings starts with the prompt.
* beam search (``beam_width`` > 1, with ``length_penalty`` and ``early_stopping``:
  true, false or "never") comes back as ``n`` texts, best first. With ``stream: true``
  the server still sends them in one final response: a beam rewrites its earlier
  tokens whenever a better-scoring sibling takes over, so there are no deltas to send
  before the search ends. Combinations that cannot apply are errors naming the field
  (``n`` above ``beam_width``, a temperature, penalties, seeds, stop strings, logprobs;
  the engine adds ``beam_width`` above ``max_num_seqs``).
* ``structured_outputs`` (vLLM's keys: ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``; a schema as a nested object or as JSON text; the whole object may
  also come as JSON text) or, by vLLM's older name, ``guided_decoding``.
* a LoRA adapter is named as vllm_backend names it, ``lora_name`` among the sampling
  parameters, or by the optional ``lora_name`` input (one of the two; empty: none). The
  model resolves the name against its ``multi_lora.json``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pagedllm.core.sampling_params import SamplingParams

RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
# pagedllm's own optional input (vllm_backend has none such): see ReturnFlags.sparse.
SPARSE_OUTPUTS = "sparse_additional_outputs"
BOOL_INPUTS = ("stream", "exclude_input_in_output", *RETURN_FLAGS, SPARSE_OUTPUTS)

# The model configuration Triton should see; config.pbtxt spells the same thing out.
INPUT_SPECS: tuple[dict[str, Any], ...] = (
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    *({"name": name, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for name in BOOL_INPUTS[1:]),
    {"name": "lora_name", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
)
OUTPUT_SPECS: tuple[dict[str, Any], ...] = (
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    # With sampling_parameters.prompt_logprobs: once, JSON (pagedllm.serving.triton.response_codec).
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [1]},
)
INPUT_NAMES = tuple(spec["name"] for spec in INPUT_SPECS)
MAX_PROMPT_BYTES_PER_TOKEN = 32


@dataclass(frozen=True, slots=True)
class ReturnFlags:
    """Which optional outputs the client asked for."""

    finish_reason: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    # With the ``sparse_additional_outputs`` input: a stream's num_input_tokens comes with its first
    # response only and finish_reason only with responses in which a sample has finished, instead of
    # both with every response (vllm_backend's contract, the default). Each output tensor is a
    # shared-memory message between the stub and tritonserver and a field of every gRPC response; the
    # OpenAI front door asks for this and so sends two tensors per streamed token instead of four.
    sparse: bool = False


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A parsed, validated request, ready for the engine."""

    prompt: str
    params: SamplingParams
    stream: bool
    prepend_input: bool  # non-streaming only: put the prompt in front of each output text
    returns: ReturnFlags
    # The client's own sampling_parameters.logprobs was set: the engine computes logprobs only when
    # asked, so a request for cumulative_logprob alone runs with logprobs=0, which must not make
    # the logprobs output appear.
    logprobs_requested: bool = True
    lora_name: str | None = None  # the adapter the client named (multi-LoRA); None: the base model


def parse_request(inputs: Mapping[str, np.ndarray], parameters_json: str | None = None, *,
                  max_prompt_bytes: int | None = None) -> GenerateRequest:
    """Validate ``inputs`` (tensor name -> array) and the request's parameters JSON."""
    unexpected = sorted(set(inputs) - set(INPUT_NAMES))
    if unexpected:
        raise ValueError(f"{unexpected[0]}: unknown input tensor; expected some of {list(INPUT_NAMES)}")
    if "text_input" not in inputs:
        raise ValueError("text_input: required input is missing")
    prompt = _prompt(_single(inputs, "text_input"), max_prompt_bytes)
    flags = {name: _bool(name, _single(inputs, name)) for name in BOOL_INPUTS if name in inputs}
    stream = flags.get("stream", False)
    exclude_input = flags.get("exclude_input_in_output")
    if stream and exclude_input is False:
        raise ValueError("exclude_input_in_output: must be true when stream is true (a stream sends only new text)")
    if "sampling_parameters" in inputs:
        field, values = "sampling_parameters", _json_object(
            _text("sampling_parameters", _single(inputs, "sampling_parameters")), "sampling_parameters")
    else:
        field, values = "parameters", _json_object(parameters_json or "{}", "parameters")
    lora_name = _lora_name(inputs, values.pop("lora_name", None), field)
    params = _sampling_params(values, field)
    returns = ReturnFlags(*(flags.get(name, False) for name in RETURN_FLAGS), sparse=flags.get(SPARSE_OUTPUTS, False))
    requested = params.logprobs is not None
    if returns.cumulative_logprob and not requested and not params.use_beam_search:
        params = replace(params, logprobs=0)  # the sampled tokens' logprobs, which the sum needs
    return GenerateRequest(prompt, params, stream, prepend_input=not stream and not exclude_input, returns=returns,
                           logprobs_requested=requested, lora_name=lora_name)


def parse_sampling_parameters(text: str, field: str) -> SamplingParams:
    """Build ``SamplingParams`` from a JSON object whose values may be strings (as genai-perf sends them)."""
    return _sampling_params(_json_object(text, field), field)


def _lora_name(inputs: Mapping[str, np.ndarray], in_parameters: Any, field: str) -> str | None:
    if in_parameters is not None and not isinstance(in_parameters, str):
        raise ValueError(f"{field}: lora_name must be a string, got {type(in_parameters).__name__}")
    from_input = _text("lora_name", _single(inputs, "lora_name")) if "lora_name" in inputs else None
    if in_parameters and from_input:
        raise ValueError(f"lora_name: give it as the lora_name input or in {field}, not both")
    return in_parameters or from_input or None


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{field}: not valid JSON ({error})") from error
    except RecursionError:
        raise ValueError(f"{field}: JSON nested too deeply") from None
    if not isinstance(values, dict):
        raise ValueError(f"{field}: must be a JSON object, got {type(values).__name__}")
    return values


def _sampling_params(values: dict[str, Any], field: str) -> SamplingParams:
    values = {key: value for key, value in values.items() if value is not None}
    if "guided_decoding" in values:  # vLLM's older name for the same object
        if "structured_outputs" in values:
            raise ValueError(f"{field}: give structured_outputs or guided_decoding, not both")
        values["structured_outputs"] = values.pop("guided_decoding")
    try:
        return SamplingParams.from_dict(values)
    except ValueError as error:
        raise ValueError(f"{field}: {error}") from error


def _single(inputs: Mapping[str, np.ndarray], name: str) -> Any:
    array = np.asarray(inputs[name])
    if array.size != 1:
        raise ValueError(f"{name}: expected exactly one element, got {array.size} (shape {list(array.shape)})")
    return array.reshape(-1)[0]


def _text(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{name}: not valid UTF-8 ({error})") from error
    raise ValueError(f"{name}: expected a string, got {type(value).__name__}")


def _prompt(value: Any, max_bytes: int | None) -> str:
    if max_bytes is not None and isinstance(value, (bytes, np.bytes_)) and len(value) > max_bytes:
        raise ValueError(f"text_input: {len(value)} bytes is longer than any prompt the model takes "
                         f"(at most {max_bytes} bytes)")
    prompt = _text("text_input", value)
    if not prompt:
        raise ValueError("text_input: must not be empty")
    if max_bytes is not None and len(prompt) > max_bytes:
        raise ValueError(f"text_input: {len(prompt)} characters is longer than any prompt the model takes "
                         f"(at most {max_bytes} bytes)")
    return prompt


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    raise ValueError(f"{name}: expected a boolean, got {value!r}")
