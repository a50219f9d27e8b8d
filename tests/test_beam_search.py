"""Beam search equals transformers' ``generate(num_beams=k)``: the same hypotheses, in the same order, same scores.

The matrix: tiny fp32 llama, mistral, qwen2 and qwen3; 8 prompts each (some
sharing a long prefix); ``beam_width`` in {2, 4}, ``n`` in {1, beam_width},
``length_penalty`` in {1.0, 0.5}, ``early_stopping`` in {False, True}; 32 new
tokens with stop ids taken from the model's own greedy output, so some
hypotheses end early. Each prompt of each architecture runs one of the 16
combinations: every combination runs at least once (most on two
architectures) and every architecture sees eight, with both values of every
parameter (set ``pytest --full`` for the whole product: 512
searches a side, several minutes on two cores). The
reference runs with ``num_return_sequences=beam_width``: ``n`` only picks how many
of the same sorted hypotheses come back.

Three engine set-ups: prefix caching on, with groups admitted a few at a time
(max_num_seqs=8) so later ones hit the shared prefix; a KV pool of 24 blocks,
far less than the 8 groups want at once, with a 24-token step budget (chunked
prefill; beam groups preempted and recomputed), with prefix caching off and on.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import full_run

from pagedllm import LLM, SamplingParams
from pagedllm.core.beam_search import shared_full_blocks
from pagedllm.core.request import Request

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
NEW_TOKENS = 32
SCORE_TOLERANCE = 1e-4
COMBOS = tuple((k, n, lp, es) for k in (2, 4) for n in (1, k) for lp in (1.0, 0.5) for es in (False, True))
FULL_MATRIX = full_run.full()
TIGHT = {"num_kv_blocks": 24, "max_num_batched_tokens": 24}
SETUPS = {
    "prefix-caching": {"enable_prefix_caching": True, "max_num_seqs": 8},
    "tight-kv": {**TIGHT, "enable_prefix_caching": False},
    "tight-kv-prefix-caching": {**TIGHT, "enable_prefix_caching": True},
}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 1000, (40,), generator=generator).tolist()
    own = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (5, 9, 14, 23, 31, 7, 12, 26)]
    return [shared + tail if i % 2 else tail for i, tail in enumerate(own)]


def cases(arch: str) -> list[tuple[list[int], tuple[int, int, float, bool]]]:
    """(prompt, combination) pairs: a mixed design, or the whole product."""
    if FULL_MATRIX:
        return [(prompt, combo) for prompt in prompts() for combo in COMBOS]
    a = ARCHS.index(arch)
    return [(prompt, COMBOS[(5 * i + 3 * a) % len(COMBOS)]) for i, prompt in enumerate(prompts())]


@cache
def stop_ids(model_dir: Path) -> tuple[tuple[int, ...], ...]:
    """Per prompt: EOS (0) and two tokens of its greedy continuation, at steps 7 and 15, so that beams
    near the greedy path stop early."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return tuple(tuple(dict.fromkeys((0, o.outputs[0].token_ids[6], o.outputs[0].token_ids[14]))) for o in outs)


@cache
def reference(model_dir: Path, prompt: tuple[int, ...], width: int, length_penalty: float,
              early_stopping: bool, stops: tuple[int, ...]) -> list[tuple[list[int], float]]:
    """transformers' hypotheses (output tokens up to and including the stop token) and scores, best first."""
    model = _hf_model(model_dir)
    result = model.generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
        length_penalty=length_penalty, early_stopping=early_stopping, max_new_tokens=NEW_TOKENS,
        eos_token_id=list(stops), pad_token_id=stops[0], return_dict_in_generate=True, output_scores=True,
    )
    hypotheses = []
    for row, score in zip(result.sequences[:, len(prompt) :].tolist(), result.sequences_scores.tolist()):
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        hypotheses.append((row[:end], score))
    return hypotheses


@cache
def _hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def beam_params(combo: tuple[int, int, float, bool], stops: tuple[int, ...]) -> SamplingParams:
    width, n, length_penalty, early_stopping = combo
    return SamplingParams(beam_width=width, n=n, temperature=0, length_penalty=length_penalty,
                          early_stopping=early_stopping, max_tokens=NEW_TOKENS, stop_token_ids=stops[1:])


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_equals_transformers(arch: str, setup: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    work = cases(arch)
    # The checkpoint's EOS (0) is one stop id; the others are passed as stop_token_ids.
    stop_of = dict(zip(map(tuple, prompts()), stop_ids(model_dir)))
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=256, **SETUPS[setup])
    results = llm.generate([{"prompt_token_ids": p} for p, _ in work],
                           [beam_params(c, stop_of[tuple(p)]) for p, c in work])

    ended_early = 0
    for (prompt, combo), result in zip(work, results):
        stops = stop_of[tuple(prompt)]
        width, n, length_penalty, early_stopping = combo
        expected = reference(model_dir, tuple(prompt), width, length_penalty, early_stopping, stops)[:n]
        got = [(o.token_ids, o.score) for o in result.outputs]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected], \
            f"{combo} on a {len(prompt)}-token prompt"
        for (_, score), (_, want), output in zip(got, expected, result.outputs):
            assert score == pytest.approx(want, abs=SCORE_TOLERANCE)
            assert output.cumulative_logprob == pytest.approx(score * len(output.token_ids) ** length_penalty, abs=1e-3)
            assert output.finish_reason == ("stop" if output.token_ids[-1] in stops else "length")
            ended_early += output.finish_reason == "stop" and len(output.token_ids) < NEW_TOKENS
        assert [o.text for o in result.outputs] == [
            llm.tokenizer.decode(o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids,
                                 skip_special_tokens=True) for o in result.outputs]
    assert ended_early > 0, "no hypothesis ended at a stop id: the stop ids test nothing"
    stats = llm.stats()
    assert stats.num_blocks_used == 0, "blocks leaked"
    if "tight-kv" in setup:
        assert stats.num_preemptions > 0
    if SETUPS[setup]["enable_prefix_caching"]:
        assert stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_early_stopping_never_equals_transformers(length_penalty: float, tiny_model_dir: Callable[[str], Path]) -> None:
    """``"never"`` with a positive length penalty judges running beams at max_tokens; width 3 is not a power of 2."""
    model_dir = tiny_model_dir("llama")
    chosen = prompts()[2:4]
    stop_of = dict(zip(map(tuple, prompts()), stop_ids(model_dir)))
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=256)
    combo = (3, 3, length_penalty, "never")
    results = llm.generate([{"prompt_token_ids": p} for p in chosen],
                           [beam_params(combo, stop_of[tuple(p)]) for p in chosen])
    for prompt, result in zip(chosen, results):
        expected = reference(model_dir, tuple(prompt), 3, length_penalty, "never", stop_of[tuple(prompt)])
        assert [o.token_ids for o in result.outputs] == [tokens for tokens, _ in expected]
        assert [o.score for o in result.outputs] == pytest.approx([score for _, score in expected], abs=SCORE_TOLERANCE)


def test_a_width_4_group_holds_the_prompts_full_blocks_once(tiny_model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_model_len=512, block_size=16)
    engine = llm.engine
    prompt = torch.randint(3, 1000, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.add_request("beams", prompt, SamplingParams(beam_width=4, temperature=0, max_tokens=8, ignore_eos=True))
    full = len(prompt) // 16
    engine.step()  # prefill: the four beams fork from the prompt and share every block, the partial one too
    request = engine.scheduler.running[0].request
    assert len(request.beams) == 4 and engine.kv.num_used_blocks == full + 1
    for _ in range(3):  # decodes: a beam copies the partial block when it writes; dead beams are freed
        engine.step()
        tables = [beam.block_ids for beam in request.beams]
        assert len(tables) == 4
        assert all(table[:full] == tables[0][:full] for table in tables)
        assert all(engine.kv.blocks[block].ref_count == 4 for block in tables[0][:full])
        # Independent copies would hold 4 * (full + 1) blocks.
        assert full + 2 <= engine.kv.num_used_blocks <= full + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("fields, field", [
    ({"beam_width": 2, "n": 3}, "n"),
    ({"beam_width": 2, "temperature": 0.7}, "temperature"),
    ({"beam_width": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"beam_width": 2, "presence_penalty": 0.5}, "presence_penalty"),
    ({"beam_width": 2, "seed": 3}, "seed"),
    ({"beam_width": 2, "top_p": 0.9}, "top_p"),
    ({"beam_width": 2, "stop": ["x"]}, "stop"),
    ({"beam_width": 2, "logprobs": 2}, "logprobs"),
    ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ({"beam_width": 0}, "beam_width"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
])
def test_impossible_combinations_name_the_field(fields: dict[str, object], field: str) -> None:
    values = {"temperature": 0, **fields}
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams.from_dict(values)


def test_early_stopping_never_and_string_values_parse() -> None:
    never = SamplingParams.from_dict({"beam_width": "3", "temperature": "0", "early_stopping": "never"})
    assert never.early_stopping == "never"
    true = SamplingParams.from_dict({"beam_width": 3, "temperature": 0, "early_stopping": "true"})
    assert true.early_stopping is True


def test_engine_refuses_a_width_beyond_max_num_seqs(tiny_model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=2)
    with pytest.raises(ValueError, match="beam_width=4"):
        llm.generate("def", SamplingParams(beam_width=4, temperature=0))


def test_a_beam_request_streams_once_and_aborts_whole(tiny_model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_model_len=128)
    params = SamplingParams(beam_width=3, n=2, temperature=0, max_tokens=10, ignore_eos=True)
    streamed = list(llm.stream("def main(self):", params))
    assert len(streamed) == 1 and streamed[0].finished  # beams rewrite earlier tokens: no deltas before the end
    whole = llm.generate("def main(self):", params)[0]
    assert [o.token_ids for o in whole.outputs] == [list(d.token_ids) for d in streamed[0].outputs]
    assert llm.generate("def", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].score is None

    engine = llm.engine
    engine.add_request("cancelled", "class Foo:", params)
    for _ in range(3):
        assert engine.step() == []  # no output while the search runs
    engine.abort_request("cancelled")
    (out,) = engine.step()
    assert out.finished and [d.finish_reason for d in out.outputs] == ["abort", "abort"]
    assert not engine.has_unfinished_requests() and engine.stats().num_blocks_used == 0


def test_a_beam_request_whose_output_fails_ends_alone(tiny_model_dir: Callable[[str], Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_model_len=128)
    engine = llm.engine
    real_decode = engine.outputs.decode

    def decode(request: Request, token_ids: tuple[int, ...], finish_reason: str) -> str:
        if request.request_id == "bad":
            raise RuntimeError("detokenizer exploded")
        return real_decode(request, token_ids, finish_reason)

    monkeypatch.setattr(engine.outputs, "decode", decode)
    params = SamplingParams(beam_width=2, temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("bad", "def f():", params)
    engine.add_request("good", "class A:", params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
    assert results["bad"].finished and "detokenizer exploded" in results["bad"].error
    assert results["good"].error is None and len(results["good"].outputs[0].token_ids) == 6
    assert engine.stats().num_blocks_used == 0


def test_shared_full_blocks_counts_equal_leading_blocks_and_never_the_last_token() -> None:
    leader = list(range(12))
    assert shared_full_blocks(list(range(12)), leader, 4) == 2  # block 3 would hold the last token
    assert shared_full_blocks(list(range(13)), leader + [99], 4) == 3
    assert shared_full_blocks([0, 1, 2, 3, 4, 5, 6, 0, 8, 9], leader, 4) == 1  # differs in block 1
    assert shared_full_blocks([7, 1, 2, 3, 4], leader, 4) == 0
    assert shared_full_blocks([0, 1, 2], leader, 4) == 0
