"""One request cannot poison the engine: admission limits, per-request faults, collision-safe prefix keys."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import pagedllm.core.kv_cache_manager as kv_cache_manager
from pagedllm import LLM, SamplingParams
from pagedllm.engine.outputs import RequestOutput

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=8)


def prompt(seed: int, length: int = 20) -> list[int]:
    return torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_all(llm: LLM) -> list[RequestOutput]:
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs.extend(llm.engine.step())
    return outputs


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(n=9), "n=9"),
    (SamplingParams(stop_token_ids=(10_000_000,), min_tokens=4, max_tokens=8), "stop_token_ids"),
    (SamplingParams(n=8, max_tokens=200), "n: request can never fit"),
])
def test_requests_that_could_never_run_are_rejected_on_arrival(llm: LLM, params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request("bad", prompt(0), params)
    assert not llm.engine.has_request("bad")
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total


def test_a_request_the_sampler_fails_on_ends_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": prompt(s)} for s in (1, 2)],
                                                                   GREEDY)]
    sample = llm.engine.sampler.__call__

    def faulty(logits, rows):  # type: ignore[no-untyped-def]
        if any(row.params.seed == 666 for row in rows):
            raise RuntimeError("poisoned row")
        return sample(logits, rows)

    monkeypatch.setattr(llm.engine, "sampler", faulty)
    engine = llm.engine
    engine.add_request("good-1", prompt(1), GREEDY)
    engine.add_request("poison", prompt(3), SamplingParams(max_tokens=6, seed=666, ignore_eos=True))
    engine.add_request("good-2", prompt(2), GREEDY)
    outputs = run_all(llm)
    errors = {out.request_id: out.error for out in outputs if out.error is not None}
    assert set(errors) == {"poison"} and "poisoned row" in errors["poison"]
    tokens = {rid: [t for out in outputs if out.request_id == rid for d in out.outputs for t in d.token_ids]
              for rid in ("good-1", "good-2")}
    assert [tokens["good-1"], tokens["good-2"]] == expected
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total


def test_an_unattributable_fault_raises_and_the_engine_serves_afterwards(llm: LLM,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    expected = llm.generate({"prompt_token_ids": prompt(4)}, GREEDY)[0].outputs[0].token_ids
    execute = engine.runner.execute
    calls = iter([True])

    def failing_once(step):  # type: ignore[no-untyped-def]
        if next(calls, False):
            raise RuntimeError("device lost")
        return execute(step)

    monkeypatch.setattr(engine.runner, "execute", failing_once)
    engine.add_request("victim", prompt(5), GREEDY)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.abort_request("victim")
    run_all(llm)
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total
    assert llm.generate({"prompt_token_ids": prompt(4)}, GREEDY)[0].outputs[0].token_ids == expected


def test_a_failed_step_leaves_no_uncomputed_prefix_block_to_adopt(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests sharing a 48-token prefix are admitted in one step, the second adopting the blocks the
    first publishes for that step. The step's forward fails and the first is aborted: the second must not
    attend to blocks that were never written, nor may a later request match them."""
    engine = llm.engine
    shared = prompt(9, 48)
    second, later = shared + prompt(10, 5), shared + prompt(11, 7)
    expected = [out.outputs[0].token_ids for out in llm.generate(
        [{"prompt_token_ids": p} for p in (second, later)], GREEDY)]
    engine.kv.reset_prefix_cache()
    execute = engine.runner.execute
    calls = iter([True])

    def failing_once(step):  # type: ignore[no-untyped-def]
        if next(calls, False):
            raise RuntimeError("device lost")
        return execute(step)

    monkeypatch.setattr(engine.runner, "execute", failing_once)
    engine.add_request("first", shared + prompt(12, 6), GREEDY)
    engine.add_request("second", second, GREEDY)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.abort_request("first")
    engine.add_request("later", later, GREEDY)
    outputs: dict[str, list[int]] = {}
    for out in run_all(llm):
        for delta in out.outputs:
            outputs.setdefault(out.request_id, []).extend(delta.token_ids)
    assert [outputs["second"], outputs["later"]] == [list(tokens) for tokens in expected]
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total


def test_forced_prefix_key_collisions_never_reuse_other_tokens(model_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    plain = LLM(model=str(model_dir), dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": prompt(s, 50)} for s in (6, 7, 8)]
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, GREEDY)]
    monkeypatch.setattr(kv_cache_manager, "block_key", lambda parent, tokens, lora_int_id=0: b"constant")
    cached = LLM(model=str(model_dir), dtype="float32", max_model_len=256, enable_prefix_caching=True)
    got = [cached.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    assert cached.stats().prefix_cache_hit_tokens == 0


def test_prefix_hit_rate_counts_only_admitted_requests(model_dir: Path) -> None:
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=8, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("big", prompt(9, 100), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("blocked", prompt(10, 60), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # "big" takes 7 of 8 blocks; "blocked" stays queued
    engine.step()
    assert llm.stats().prefix_cache_queried_tokens == 100
    with pytest.raises(ValueError, match="max_tokens: request can never fit"):
        engine.add_request("too-long", prompt(11, 100), SamplingParams(max_tokens=100))
