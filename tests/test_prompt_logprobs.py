"""SamplingParams.prompt_logprobs against transformers' log-softmax of the same checkpoint (float32)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.engine.core_wire import decode_outputs, encode_outputs
from pagedllm.engine.outputs import CompletionDelta, RequestOutput

PROMPT = "import os\nimport sys\n\ndef main(argv):\n    for name in argv:\n        print(os.path.join(name))\n" * 2


def _transformers_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row p predicts token p + 1


@pytest.mark.parametrize("arch", ["qwen2"])
def test_prompt_logprobs_equal_transformers_with_chunks_and_the_prompt_already_cached(tiny_model_dir,
                                                                                     arch: str) -> None:
    """A cached prompt prefix holds no logits, so a prompt_logprobs request computes every position itself:
    the prompt is in the prefix cache (a plain request hits it), the prompt_logprobs request bypasses it."""
    model_dir = str(tiny_model_dir(arch))
    # 24-token chunks: the prompt spans several steps, and later chunks attend to earlier ones
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=24, num_kv_blocks=64, attention_backend="torch")
    ids = llm.tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 60
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([PROMPT], plain)  # leaves the prompt in the prefix cache
    hits = llm.stats().prefix_cache_hit_tokens
    llm.generate([PROMPT], plain)
    cached = llm.stats().prefix_cache_hit_tokens
    assert cached - hits >= 48, "the prompt's full blocks should be in the prefix cache"
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3)
    (out,) = llm.generate([PROMPT], params)
    assert llm.stats().prefix_cache_hit_tokens == cached, "a prompt_logprobs request must not start from the cache"
    expected = _transformers_logprobs(model_dir, ids)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for position in range(1, len(ids)):
        entry = got[position]
        token = ids[position]
        assert abs(entry[token] - float(expected[position - 1, token])) < 1e-4
        top = expected[position - 1].topk(3)
        for value, index in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[index] - value) < 1e-4
        assert len(entry) in (3, 4)  # the top 3, and the prompt's own token when it is not among them
    # the request still generated normally
    assert len(out.outputs[0].token_ids) == 3


def test_prompt_logprobs_zero_gives_the_prompt_tokens_only_and_validates(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_kv_blocks=32, attention_backend="torch")
    (out,) = llm.generate(["a b c d e"], SamplingParams(max_tokens=1, prompt_logprobs=0))
    ids = out.prompt_token_ids
    assert [None if entry is None else list(entry) for entry in out.prompt_logprobs] == [None] + [[t] for t in ids[1:]]
    (plain,) = llm.generate(["a b c d e"], SamplingParams(max_tokens=1))
    assert plain.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(["a"], SamplingParams(prompt_logprobs=21))


def test_prompt_logprobs_cross_the_engine_process_wire() -> None:
    output = RequestOutput("r", None, (1, 2), (), True, None, [None, {2: -0.5, 7: -0.1}])
    (received,) = decode_outputs(encode_outputs([output]), {"r": ("p", (1, 2))})
    assert received.prompt_logprobs == [None, {2: -0.5, 7: -0.1}]


def test_the_triton_response_carries_prompt_logprobs_once() -> None:
    from pagedllm.serving.triton.request_codec import GenerateRequest, ReturnFlags
    from pagedllm.serving.triton.response_codec import ResponseAssembler, merge_tensors

    request = GenerateRequest("p", SamplingParams(prompt_logprobs=1), stream=True, prepend_input=False,
                              returns=ReturnFlags())
    assembler = ResponseAssembler(request, decode_token=lambda token: f"<{token}>")
    first = assembler.add(RequestOutput("r", "p", (4, 5), (CompletionDelta(0, "a", (9,), None, None, None),), False,
                                        None, [None, {5: -0.25, 8: -0.1}]))
    second = assembler.add(RequestOutput("r", "p", (4, 5), (CompletionDelta(0, "b", (9,), None, None, "length"),),
                                         True, None))
    assert "prompt_logprobs" not in second
    entries = json.loads(first["prompt_logprobs"][0])
    assert entries[0] == {"4": {"logprob": None, "rank": None, "decoded_token": "<4>"}}
    assert list(entries[1]) == ["5", "8"]  # the prompt's own token first, then the top-k by rank
    assert entries[1]["5"] == {"logprob": -0.25, "rank": 2, "decoded_token": "<5>"}
    assert merge_tensors([first, second])["prompt_logprobs"][0] == first["prompt_logprobs"][0]
