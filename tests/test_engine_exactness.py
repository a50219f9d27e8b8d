"""Greedy tokens from pagedllm equal transformers' own ``generate``, token for token (fp32).

Each architecture runs 16 prompts of 5-300 tokens for 64 new tokens under
three engine set-ups: defaults; a cache barely bigger than one request with a
32-token step budget, so chunked prefill and preemption both happen; and
prompts sharing long prefixes, so the prefix cache is hit.

Random-weight models occasionally produce exact fp32 ties between the top two
logits, where either pick is right and the order of float additions decides.
Sequences must be identical up to such a tie (margin below ``TIE``); after a
tie the continuations may differ. Ties are rare: most sequences must match in
full.
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

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
NEW_TOKENS = 64
TIE = 1e-4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def random_prompts(seed: int, count: int = 16) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(5, 300, count).long().tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    systems = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (70, 150)]
    return [
        systems[i % 2] + torch.randint(3, 1000, (5 + 7 * i,), generator=generator).tolist() for i in range(8)
    ]


@cache
def reference(model_dir: Path, prompts: tuple[tuple[int, ...], ...]) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and, per step, the margin between its top two logits."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # match ignore_eos
    out = []
    for prompt in prompts:
        result = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        margins = [float(top[0, 0] - top[0, 1]) for top in (s.topk(2).values for s in result.logits)]
        out.append((result.sequences[0, len(prompt) :].tolist(), margins))
    return out


def assert_matches_reference(model_dir: Path, prompts: list[list[int]], got: list[list[int]]) -> None:
    expected = reference(model_dir, tuple(map(tuple, prompts)))
    diverged = 0
    for index, (tokens, (want, margins)) in enumerate(zip(got, expected)):
        if tokens == want:
            continue
        step = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
        assert margins[step] < TIE, (
            f"prompt {index} diverges from transformers at step {step} where its top-2 margin is "
            f"{margins[step]:.2e}, not a tie"
        )
        diverged += 1
    assert diverged <= len(prompts) // 8, f"{diverged} of {len(prompts)} sequences hit ties: too many to trust"


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
def test_a_cuda_engine_with_the_triton_kernels_matches_transformers(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(seed=3)
    llm = LLM(model=str(model_dir), dtype="float32", device="cuda")
    assert_matches_reference(model_dir, prompts, generate(llm, prompts))


@pytest.mark.parametrize("arch", ARCHS)
def test_defaults_match_transformers(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = random_prompts(seed=1)
    llm = LLM(model=str(model_dir), dtype="float32")
    assert_matches_reference(model_dir, prompts, generate(llm, prompts))
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total


@pytest.mark.parametrize("arch", ARCHS)
def test_tight_cache_preempts_and_chunks_yet_matches(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = random_prompts(seed=1)
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    llm = LLM(
        model=str(model_dir), dtype="float32", num_kv_blocks=-(-longest // 16) + 2, max_num_batched_tokens=32
    )
    assert_matches_reference(model_dir, prompts, generate(llm, prompts))
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.peak_blocks_used == stats.num_blocks_total
    assert stats.num_blocks_free == stats.num_blocks_total


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_yet_matches(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = shared_prefix_prompts(seed=2)
    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=2)
    assert_matches_reference(model_dir, prompts, generate(llm, prompts))
    assert llm.stats().prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("arch", ARCHS if full_run.full() else ("qwen3",))
def test_prefix_computed_in_the_same_step_is_shared_yet_matches(arch: str,
                                                                tiny_model_dir: Callable[[str], Path]) -> None:
    """A 200-token step budget: the first prompt of each system prompt computes it (the second in two chunks),
    and the prompts admitted beside it adopt its blocks in the step that computes them, attending to them in
    that same forward."""
    model_dir = tiny_model_dir(arch)
    prompts = shared_prefix_prompts(seed=2)
    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=200)
    assert_matches_reference(model_dir, prompts, generate(llm, prompts))
    # Every prompt but the first of each system prompt finds that prompt's full blocks.
    assert llm.stats().prefix_cache_hit_tokens == 3 * (64 + 144)
