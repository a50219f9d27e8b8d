"""Engine deltas -> vllm_backend-compatible output tensors, without Triton."""
from __future__ import annotations

import json

import numpy as np

from pagedllm.engine.outputs import CompletionDelta, RequestOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.serving.triton.request_codec import GenerateRequest, ReturnFlags
from pagedllm.serving.triton.response_codec import ResponseAssembler, merge_tensors

ALL_RETURNS = ReturnFlags(True, True, True, True, True)


def request(stream: bool, prepend: bool = False, n: int = 1, logprobs: int | None = None,
            returns: ReturnFlags = ALL_RETURNS) -> GenerateRequest:
    return GenerateRequest("Say:", SamplingParams(n=n, logprobs=logprobs), stream, prepend, returns)


def step(deltas: list[CompletionDelta], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "Say:", (5, 6, 7), tuple(deltas), finished)


def delta(index: int, text: str, tokens: tuple[int, ...], cum: float, reason: str | None = None,
          logprobs: tuple[dict[int, float], ...] | None = None) -> CompletionDelta:
    return CompletionDelta(index, text, tokens, cum, logprobs, reason)


def strings(array: np.ndarray) -> list[str]:
    return [item.decode() for item in array]


def test_streaming_sends_each_delta_with_per_sample_entries() -> None:
    assembler = ResponseAssembler(request(stream=True, n=2), decode_token=str)
    first = assembler.add(step([delta(0, " a", (10,), -1.0), delta(1, " b", (11,), -2.0)]))
    second = assembler.add(step([delta(1, "c", (12, 13), -3.0, "stop")]))
    last = assembler.add(step([delta(0, "", (14,), -1.5, "length")], finished=True))
    assert strings(first["text_output"]) == [" a", " b"]
    assert strings(second["text_output"]) == ["", "c"]
    assert strings(last["text_output"]) == ["", ""]
    assert strings(second["finish_reason"]) == ["None", "stop"]
    assert strings(last["finish_reason"]) == ["length", "stop"]
    assert second["num_output_tokens"].tolist() == [0, 2]
    assert second["num_output_tokens"].dtype == np.uint32
    assert second["cumulative_logprob"].tolist() == [-1.0, -3.0]
    assert second["cumulative_logprob"].dtype == np.float32
    assert last["num_input_tokens"].tolist() == [3]
    assert strings(last["logprobs"]) == ["null", "null"]


def test_logprobs_added_only_for_the_cumulative_sum_are_not_returned() -> None:
    cumulative_only = GenerateRequest("Say:", SamplingParams(logprobs=0), True, False, ALL_RETURNS,
                                      logprobs_requested=False)
    tensors = ResponseAssembler(cumulative_only, decode_token=str).add(
        step([delta(0, " a", (10,), -1.5, "length", ({10: -1.5},))], finished=True))
    assert tensors is not None
    assert tensors["cumulative_logprob"].tolist() == [-1.5]
    assert strings(tensors["logprobs"]) == ["null"]


def test_non_streaming_sends_one_response_with_the_prompt_prepended() -> None:
    assembler = ResponseAssembler(request(stream=False, prepend=True, n=2), decode_token=str)
    assert assembler.add(step([delta(0, " x", (1,), -1.0), delta(1, " y", (2,), -1.0)])) is None
    final = assembler.add(step([delta(0, "z", (3,), -2.0, "length"), delta(1, "w", (4,), -2.0, "stop")], True))
    assert strings(final["text_output"]) == ["Say: xz", "Say: yw"]
    assert final["num_output_tokens"].tolist() == [2, 2]
    assert strings(final["finish_reason"]) == ["length", "stop"]


def test_non_streaming_without_the_prompt() -> None:
    assembler = ResponseAssembler(request(stream=False, prepend=False, returns=ReturnFlags()), decode_token=str)
    final = assembler.add(step([delta(0, "hello", (1, 2), -1.0, "stop")], finished=True))
    assert list(final) == ["text_output"]
    assert strings(final["text_output"]) == ["hello"]


def test_multibyte_text_is_utf8_encoded() -> None:
    assembler = ResponseAssembler(request(stream=True), decode_token=str)
    out = assembler.add(step([delta(0, "né ☃", (1,), -1.0)]))
    assert out["text_output"][0] == "né ☃".encode()


def test_logprobs_are_json_with_rank_and_decoded_token() -> None:
    assembler = ResponseAssembler(request(stream=True, logprobs=2), decode_token=lambda t: f"<{t}>")
    inside = {7: -0.1, 8: -2.5}  # chosen token 7 is in the top-2
    outside = {3: -0.2, 4: -0.9, 9: -4.0}  # chosen token 9 is not: three entries, ranked just below the top-2
    out = assembler.add(step([delta(0, "ab", (7, 9), -4.1, logprobs=(inside, outside))]))
    tokens = json.loads(out["logprobs"][0])
    assert tokens == [
        {"7": {"logprob": -0.1, "rank": 1, "decoded_token": "<7>"},
         "8": {"logprob": -2.5, "rank": 2, "decoded_token": "<8>"}},
        {"3": {"logprob": -0.2, "rank": 1, "decoded_token": "<3>"},
         "4": {"logprob": -0.9, "rank": 2, "decoded_token": "<4>"},
         "9": {"logprob": -4.0, "rank": 3, "decoded_token": "<9>"}},
    ]


def test_merged_stream_chunks_add_up_to_one_response() -> None:
    assembler = ResponseAssembler(request(stream=True, n=2, logprobs=0), decode_token=str)
    first = assembler.add(step([delta(0, "é", (1,), -1.0, logprobs=({1: -1.0},)),
                                delta(1, "x", (2,), -2.0, logprobs=({2: -2.0},))]))
    second = assembler.add(step([delta(0, "☃", (3, 4), -3.0, "length", logprobs=({3: -1.0}, {4: -1.0}))], True))
    merged = merge_tensors([first, second])
    assert strings(merged["text_output"]) == ["é☃", "x"]
    assert merged["num_output_tokens"].tolist() == [3, 1] and merged["num_output_tokens"].dtype == np.uint32
    assert strings(merged["finish_reason"]) == ["length", "None"]
    assert merged["cumulative_logprob"].tolist() == [-3.0, -2.0]
    assert [[int(t) for entry in json.loads(s) for t in entry] for s in merged["logprobs"]] == [[1, 3, 4], [2]]
    assert merge_tensors([first])["text_output"].tolist() == first["text_output"].tolist()


def test_sparse_outputs_send_the_prompt_length_once_and_finish_reasons_once_set() -> None:
    sparse = ReturnFlags(True, False, False, True, True, sparse=True)
    assembler = ResponseAssembler(request(stream=True, n=2, returns=sparse), decode_token=str)
    first = assembler.add(step([delta(0, " a", (10,), -1.0), delta(1, " b", (11,), -2.0)]))
    second = assembler.add(step([delta(1, "c", (12,), -3.0, "stop")]))
    last = assembler.add(step([delta(0, "d", (14,), -1.5, "length")], finished=True))
    assert set(first) == {"text_output", "num_input_tokens", "num_output_tokens"}
    assert first["num_input_tokens"].tolist() == [3]
    assert set(second) == set(last) == {"text_output", "finish_reason", "num_output_tokens"}
    assert strings(second["finish_reason"]) == ["None", "stop"] and strings(last["finish_reason"]) == ["length", "stop"]
    # A backlog merged into one response keeps the first chunk's prompt length.
    merged = merge_tensors([first, second, last])
    assert merged["num_input_tokens"].tolist() == [3] and strings(merged["finish_reason"]) == ["length", "stop"]
    assert strings(merged["text_output"]) == [" ad", " bc"] and merged["num_output_tokens"].tolist() == [2, 2]


def test_a_non_streaming_response_carries_everything_with_sparse_outputs() -> None:
    sparse = ReturnFlags(True, False, False, True, True, sparse=True)
    assembler = ResponseAssembler(request(stream=False, returns=sparse), decode_token=str)
    assert assembler.add(step([delta(0, " a", (10,), -1.0)])) is None
    tensors = assembler.add(step([delta(0, "b", (11,), -2.0, "stop")], finished=True))
    assert tensors is not None and tensors["num_input_tokens"].tolist() == [3]
    assert strings(tensors["finish_reason"]) == ["stop"]
