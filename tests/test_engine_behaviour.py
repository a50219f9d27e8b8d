"""Engine behaviour beyond greedy exactness: sharing, seeds, stopping, aborts, bad input."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import SampleStatus


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]) -> LLM:
    return LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=512)


def token_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def spy_on_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record how many tokens each engine step computes."""
    seen: list[int] = []
    execute = llm.engine.runner.execute

    def recording(step):  # type: ignore[no-untyped-def]
        seen.append(step.num_tokens)
        return execute(step)

    monkeypatch.setattr(llm.engine.runner, "execute", recording)
    return seen


def test_second_request_computes_only_its_suffix(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = token_prompt(1, 64)
    llm.generate({"prompt_token_ids": shared + token_prompt(2, 10)}, SamplingParams(max_tokens=1))
    seen = spy_on_steps(llm, monkeypatch)
    hits_before = llm.stats().prefix_cache_hit_tokens
    suffix = token_prompt(3, 9)
    llm.generate({"prompt_token_ids": shared + suffix}, SamplingParams(max_tokens=1))
    assert llm.stats().prefix_cache_hit_tokens - hits_before == 64
    assert seen == [len(suffix)]


def test_parallel_samples_share_prompt_blocks_copy_on_write(llm: LLM) -> None:
    engine = llm.engine
    prompt = token_prompt(4, 40)  # two full blocks and a partial one
    engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    while len(engine._requests["fork"].sequences) < 4:
        engine.step()
    sequences = engine._requests["fork"].sequences
    full_blocks = sequences[0].block_ids[:2]
    assert all(seq.block_ids[:2] == full_blocks for seq in sequences)
    assert [engine.kv.blocks[b].ref_count for b in full_blocks] == [4, 4]
    engine.step()  # each sample writes its own token into the shared partial block
    partial = {seq.block_ids[2] for seq in sequences}
    assert len(partial) == 4, "the shared partial block was not copied on write"
    assert [engine.kv.blocks[b].ref_count for b in full_blocks] == [4, 4]
    while engine.has_unfinished_requests():
        engine.step()
    assert all(seq.status is SampleStatus.FINISHED for seq in sequences)
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total


def test_n_samples_differ_but_reproduce(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate("def main():", params)[0]
    again = llm.generate("def main():", params)[0]
    samples = [o.token_ids for o in first.outputs]
    assert samples == [o.token_ids for o in again.outputs]
    assert len({tuple(s) for s in samples}) > 1


def test_seeded_sample_is_independent_of_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("import os", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True)] * 3
    mixed = llm.generate(["class A:", "x = 1", "import os", "for i in"], [others[0], others[1], seeded, others[2]])
    reordered = llm.generate(["import os", "while True:"], [seeded, others[0]])
    assert mixed[2].outputs[0].token_ids == alone
    assert reordered[0].outputs[0].token_ids == alone


def test_stop_string_spanning_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, skip_special_tokens=True)
    full = llm.generate("def add(a, b):", greedy)[0].outputs[0]
    text = full.text
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # A stop string made of the tail of token 5 and the head of token 6 crosses a token boundary.
    boundary = len("".join(pieces[:6]))
    stop = text[boundary - 2 : boundary + 2]
    assert len(stop) == 4 and text.find(stop) == boundary - 2
    cut = llm.generate("def add(a, b):", SamplingParams(**{**_fields(greedy), "stop": (stop,)}))[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: boundary - 2]
    kept = SamplingParams(**{**_fields(greedy), "stop": (stop,), "include_stop_str_in_output": True})
    assert llm.generate("def add(a, b):", kept)[0].outputs[0].text == text[: boundary + 2]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_stop_token_ids_min_tokens_and_length(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate("x = ", greedy)[0].outputs[0].token_ids
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    out = llm.generate("x = ", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(stop_id,)))
    assert out[0].outputs[0].token_ids == tokens[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    longer = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(stop_id,), min_tokens=first + 2)
    kept = llm.generate("x = ", longer)[0].outputs[0].token_ids
    assert len(kept) > first + 1 and stop_id not in kept[: first + 2]
    assert llm.generate("x = ", greedy)[0].outputs[0].finish_reason == "length"


def test_logprobs_are_returned_per_token(llm: LLM) -> None:
    out = llm.generate("a", SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token, top in zip(out.token_ids, out.logprobs):
        assert token in top and len(top) >= 3
        assert max(top.values()) == pytest.approx(top[token])  # greedy picks the most likely
    assert out.cumulative_logprob == pytest.approx(sum(top[t] for t, top in zip(out.token_ids, out.logprobs)))


def test_cumulative_logprob_is_computed_only_when_logprobs_are_asked_for(llm: LLM) -> None:
    plain = llm.generate("a", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert plain.cumulative_logprob is None and plain.logprobs is None
    chosen = llm.generate("a", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0))[0].outputs[0]
    assert chosen.token_ids == plain.token_ids
    assert chosen.logprobs is not None and [list(top) for top in chosen.logprobs] == [[t] for t in chosen.token_ids]
    assert chosen.cumulative_logprob == pytest.approx(sum(top[t] for t, top in zip(chosen.token_ids, chosen.logprobs)))
    assert chosen.cumulative_logprob < 0


def test_stream_deltas_concatenate_to_generate(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    whole = llm.generate("print(", params)[0].outputs[0]
    deltas = list(llm.stream("print(", params))
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == whole.token_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_abort_frees_blocks_and_reports(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("gone", token_prompt(9, 50), SamplingParams(max_tokens=100, ignore_eos=True, n=2, temperature=1.0))
    for _ in range(3):
        engine.step()
    assert llm.stats().num_blocks_free < llm.stats().num_blocks_total
    engine.abort_request("gone")
    (out,) = engine.step()
    assert out.finished and {d.finish_reason for d in out.outputs} == {"abort"}
    assert sorted(d.index for d in out.outputs) == [0, 1]
    assert not engine.has_unfinished_requests()
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", 0, "top_k"),
        ("top_k", -2, "top_k"),
        ("min_p", 1.5, "min_p"),
        ("max_tokens", 0, "max_tokens"),
        ("n", 0, "n"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("presence_penalty", -3.0, "presence_penalty"),
        ("frequency_penalty", 2.5, "frequency_penalty"),
        ("min_tokens", -1, "min_tokens"),
        ("logprobs", -1, "logprobs"),
        ("colour", "red", "colour"),
    ],
)
def test_bad_sampling_params_name_the_field(llm: LLM, field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict({field: value})
    with pytest.raises(ValueError, match=message):
        llm.generate("hello", {field: value})


def test_bad_prompts_are_rejected_without_leaking(llm: LLM, tiny_model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": token_prompt(1, 600)}, SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate({"prompt_token_ids": token_prompt(1, 500)}, SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 2, 10**6]}, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, -4]}, SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", {"text": "not a prompt"}], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total
    small = LLM(model=str(tiny_model_dir("llama")), dtype="float32", num_kv_blocks=4)
    with pytest.raises(ValueError, match="never fit in the KV cache"):
        small.generate({"prompt_token_ids": token_prompt(1, 60)}, SamplingParams(max_tokens=10))


def test_bad_engine_arguments_name_the_key(tiny_model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="block_sise"):
        LLM(model=str(tiny_model_dir("llama")), block_sise=16)
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=str(tiny_model_dir("llama")), block_size=12)
    with pytest.raises(ValueError, match="not a Hugging Face checkpoint"):
        LLM(model="/nonexistent/model")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
            LLM(model=str(tiny_model_dir("llama")), cuda_graphs=True)


def test_static_batching_admits_the_next_batch_only_when_one_finishes(tiny_model_dir: Callable[[str], Path]) -> None:
    static = LLM(model=str(tiny_model_dir("llama")), dtype="float32", scheduling="static", max_num_seqs=2)
    engine = static.engine
    lengths = {"a": 3, "b": 9, "c": 2}
    for request_id, max_tokens in lengths.items():
        engine.add_request(request_id, token_prompt(ord(request_id), 20),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finished: list[str] = []
    while engine.has_unfinished_requests():
        running = {seq.request.request_id for seq in engine.scheduler.running}
        assert "c" not in running or {"a", "b"} <= set(finished), "c joined a batch that had not finished"
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["a", "b", "c"]
    continuous = LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=2)
    prompts = [{"prompt_token_ids": token_prompt(ord(r), 20)} for r in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths.values()]
    assert [o.outputs[0].token_ids for o in static.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in continuous.generate(prompts, params)
    ]
