"""Greedy tokens with speculative decoding equal those without, through the real scheduler, runner and sampler.

A random-weight model rarely repeats itself, so prompt lookup would seldom be right; to exercise
acceptance, rollback and trimming, most cases swap the engine's n-gram proposer for an oracle that
proposes the non-speculative engine's own continuation with a quarter of its tokens corrupted (so runs
are partly accepted, fully accepted and rejected at every position). Each case compares token ids,
text, finish reasons and logprobs (1e-4) with the engine without speculation, under a tight KV pool
with preemption asserted, prefix-cache hits, ``n = 2`` with penalties, and stop strings and stop ids
landing inside accepted runs. One case runs the real n-gram proposer on self-repeating prompts.

llama runs every case; ``pytest --full`` runs them all on qwen3 and qwen3_moe too (by default
those two run the tight-pool case), a batch mixing a LoRA adapter with the base model, and TP=2.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import full_run
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import Sample as EngineSequence

FULL = full_run.full()
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 0}
NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


class OracleProposer:
    """Proposes each sample's known continuation, every token corrupted with probability ``error_rate``."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], error_rate: float = 0.25) -> None:
        self.continuations = continuations
        self.error_rate = error_rate
        self.rng = random.Random(0)

    def propose(self, seqs: Sequence[EngineSequence], max_tokens: Sequence[int]) -> list[list[int]]:
        proposals = []
        for seq, limit in zip(seqs, max_tokens):
            known = self.continuations[tuple(seq.prompt_token_ids)][seq.num_output_tokens :][: min(K, limit)]
            proposals.append([t if self.rng.random() >= self.error_rate else (t + 1) % 1000 for t in known])
        return proposals

    def release(self, seq_ids: object) -> None:
        pass


@dataclass(frozen=True)
class Result:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    logprobs: tuple[dict[int, float], ...] | None


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[Result]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[Result(tuple(c.token_ids), c.text, c.finish_reason, None if c.logprobs is None else tuple(c.logprobs))
             for c in out.outputs] for out in outs]


def assert_same(got: list[list[Result]], want: list[list[Result]]) -> None:
    for index, (samples, expected) in enumerate(zip(got, want)):
        for sample, reference in zip(samples, expected, strict=True):
            assert sample.token_ids == reference.token_ids, f"prompt {index}: tokens differ"
            assert (sample.text, sample.finish_reason) == (reference.text, reference.finish_reason), f"prompt {index}"
            if reference.logprobs is not None:
                assert sample.logprobs is not None
                for mine, theirs in zip(sample.logprobs, reference.logprobs, strict=True):
                    assert mine.keys() == theirs.keys()
                    assert max(abs(mine[t] - theirs[t]) for t in theirs) < 1e-4


def random_prompts(seed: int, lengths: Sequence[int] = (5, 23, 60, 97, 150, 12)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def speculative(model_dir: Path, continuations: dict[tuple[int, ...], list[int]] | None, **engine_args: object) -> LLM:
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=NGRAM, **engine_args)
    if continuations is not None:
        assert llm.engine.speculative is not None
        llm.engine.speculative.proposer = OracleProposer(continuations)  # type: ignore[assignment]
    return llm


def continuations_of(prompts: list[list[int]], results: list[list[Result]]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): list(r[0].token_ids) for p, r in zip(prompts, results)}


def assert_speculated(llm: LLM) -> None:
    counts = llm.engine.stats().spec_decode
    assert counts is not None and counts.num_accepted_tokens > 0 and counts.num_draft_tokens > counts.num_accepted_tokens
    assert sum(counts.num_accepted_tokens_per_pos) == counts.num_accepted_tokens
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def case_tight_pool_with_logprobs(model_dir: Path) -> None:
    prompts = random_prompts(seed=1)
    params = replace(GREEDY, logprobs=3)
    tight = {"num_kv_blocks": -(-(150 + NEW_TOKENS + K) // 16) + 2, "max_num_batched_tokens": 32}
    want = run(LLM(model=str(model_dir), dtype="float32", **tight), prompts, params)
    llm = speculative(model_dir, continuations_of(prompts, want), **tight)
    assert_same(run(llm, prompts, params), want)
    assert llm.stats().num_preemptions > 0
    assert_speculated(llm)


def case_prefix_hits(model_dir: Path) -> None:
    generator = torch.Generator().manual_seed(2)
    system = torch.randint(3, 1000, (70,), generator=generator).tolist()
    prompts = [system + torch.randint(3, 1000, (5 + 7 * i,), generator=generator).tolist() for i in range(5)]
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    llm = speculative(model_dir, continuations_of(prompts, want), max_num_seqs=2)
    assert_same(run(llm, prompts, GREEDY), want)
    assert llm.stats().prefix_cache_hit_tokens > 0
    assert_speculated(llm)


def case_two_samples_with_penalties(model_dir: Path) -> None:
    # Prompts of one repeated token lead a random model to repeat itself, where penalties decide.
    prompts = random_prompts(seed=3)[:2] + [[token] * 30 for token in (17, 321, 999)]
    params = replace(GREEDY, n=2, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3)
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, params)
    llm = speculative(model_dir, continuations_of(prompts, want))
    assert_same(run(llm, prompts, params), want)
    assert_speculated(llm)


def case_stops_inside_accepted_runs(model_dir: Path) -> None:
    prompts = random_prompts(seed=4)[:4]
    full = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    llm_plain = LLM(model=str(model_dir), dtype="float32")
    # A stop id and a stop string from the middle of the first and second continuations.
    stop_id = full[0][0].token_ids[17]
    text = full[1][0].text
    stop_string = text[len(text) // 2 : len(text) // 2 + 3]
    params = replace(GREEDY, stop_token_ids=(stop_id,), stop=(stop_string,), min_tokens=2)
    want = run(llm_plain, prompts, params)
    assert {r[0].finish_reason for r in want[:2]} == {"stop"}
    llm = speculative(model_dir, continuations_of(prompts, full))
    assert_same(run(llm, prompts, params), want)
    assert_speculated(llm)


def case_real_ngram_proposer(model_dir: Path) -> None:
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (12,), generator=generator).tolist() * 4 for _ in range(3)]
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    llm = speculative(model_dir, None)
    assert_same(run(llm, prompts, GREEDY), want)
    counts = llm.engine.stats().spec_decode
    assert counts is not None and counts.num_drafts > 0


CASES: dict[str, Callable[[Path], None]] = {
    "tight_pool_logprobs": case_tight_pool_with_logprobs,
    "prefix_hits": case_prefix_hits,
    "n2_penalties": case_two_samples_with_penalties,
    "stops": case_stops_inside_accepted_runs,
    "ngram": case_real_ngram_proposer,
}
MATRIX = [("llama", name) for name in CASES] + [
    (arch, name) for arch in ("qwen3", "qwen3_moe") for name in CASES if FULL or name == "tight_pool_logprobs"]


@pytest.mark.parametrize(("arch", "case"), MATRIX)
def test_greedy_with_speculation_equals_without(arch: str, case: str, tiny_model_dir: Callable[[str], Path]) -> None:
    CASES[case](tiny_model_dir(arch))


def test_each_verified_position_counts_the_drafts_before_it(tiny_model_dir: Callable[[str], Path]) -> None:
    """Penalties see the drafted tokens before a position; min_tokens counts them as output."""
    llm = speculative(tiny_model_dir("llama"), None)
    engine = llm.engine
    params = SamplingParams(max_tokens=10, repetition_penalty=1.5, min_tokens=3, stop_token_ids=(9,))
    engine.add_request("r", [5, 6, 7], params)
    seq = engine._requests["r"].sequences[0]
    base = engine._sampling_row(seq)
    vocab = engine.model.vocab_size
    assert engine.speculative is not None
    rows = [engine.speculative._position_row(seq, base, drafts) for drafts in ((11,), (11, 12), (11, 12, 11))]
    counts = [row.penalties.tensors(vocab, torch.device("cpu"), torch.float32)[1] for row in rows]
    assert [(c[11].item(), c[12].item()) for c in counts] == [(1, 0), (1, 1), (2, 1)]
    assert base.penalties is not None and base.penalties.tensors(vocab, torch.device("cpu"), torch.float32)[1].sum() == 0
    assert [9 in row.suppressed_token_ids for row in rows] == [True, True, False]  # 3 outputs reach min_tokens
    llm.engine.abort_request("r")
    llm.engine.step()


def test_speculation_turns_off_above_disable_by_batch_size() -> None:
    # The embedded model copies the code it has seen, so prompt lookup finds drafts.
    prompt = "def area(width, height):\n    return width * height\n\n\ndef area("
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
              "disable_by_batch_size": 3}
    few, many = LLM(speculative_config=config), LLM(speculative_config=config)
    few.generate([prompt] * 3, params)
    many.generate([prompt] * 4, params)  # all four run side by side to the end
    few_counts, many_counts = few.stats().spec_decode, many.stats().spec_decode
    assert few_counts is not None and few_counts.num_drafts > 0
    assert many_counts is not None and many_counts.num_drafts == 0


@pytest.mark.skipif(not FULL, reason="pytest --full runs it (about a minute: peft builds the adapter)")
def test_lora_adapter_with_speculation(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """A batch mixing an adapter and the base model verifies through each one's own weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagedllm import LoRARequest

    base = tiny_model_dir("llama")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                           task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: an adapter that changes nothing
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompts = random_prompts(seed=6)[:4]
    loras = [adapter, None, adapter, None]
    plain = LLM(model=str(base), dtype="float32", enable_lora=True)
    want = [[Result(tuple(c.token_ids), c.text, c.finish_reason, None) for c in out.outputs]
            for out in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)]
    assert want[0][0].token_ids != run(plain, prompts[:1], GREEDY)[0][0].token_ids, "the adapter changes nothing"
    llm = speculative(base, continuations_of(prompts, want), enable_lora=True)
    got = [[Result(tuple(c.token_ids), c.text, c.finish_reason, None) for c in out.outputs]
           for out in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)]
    assert_same(got, want)
    assert_speculated(llm)


@pytest.mark.skipif(not FULL, reason="pytest --full runs it (starts a tensor-parallel worker process)")
def test_tensor_parallel_with_speculation(tiny_model_dir: Callable[[str], Path]) -> None:
    """Proposals and verification on rank 0; every rank runs the k + 1 positions."""
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(seed=1)[:4]
    params = replace(GREEDY, logprobs=2)
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, params)
    with speculative(model_dir, continuations_of(prompts, want), tensor_parallel_size=2) as llm:
        assert_same(run(llm, prompts, params), want)
        assert_speculated(llm)
