"""Mixtral, Qwen3-MoE and Qwen2-MoE: greedy tokens equal transformers' ``generate`` (fp32), token for token.

The tiny checkpoints (``make_tiny_model``) cover the router variants and the
layer mixes: Mixtral (8 experts, top-2, renormalised, every layer sparse),
Qwen3-MoE (16 experts, top-4, ``norm_topk_prob`` true, layer 1 dense through
``mlp_only_layers``) and Qwen2-MoE (12 experts, top-4, ``norm_topk_prob``
false, a gated shared expert, dense and sparse layers alternating through
``decoder_sparse_step=2``).

The default run takes each architecture through logits against transformers'
forward and greedy decoding with the defaults, then one architecture each
through a tight KV pool (preemption and chunked prefill asserted),
prefix-cache hits, beam search, ``norm_topk_prob`` flipped, and tensor
parallelism over two ranks. ``pytest --full`` runs every
architecture through all of them.
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
from pagedllm.models.llama import MLP
from pagedllm.layers.moe import SparseMoeBlock
from pagedllm.testing.tiny_model import make_tiny_model

from test_beam_search import reference as beam_reference  # noqa: E402
from test_models import load, make_caches, make_sequences, reference_logits, run_step  # noqa: E402

ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
FULL_MATRIX = full_run.full()
NEW_TOKENS = 24
TIE = 1e-4
# Packed CPU GEMMs add in another order than transformers' F.linear; through four MoE layers the float32
# logits (up to ~12) move by up to ~1.5e-4 (the dense models' 1e-4 plus the routed experts' own GEMMs).
LOGIT_ATOL = 3e-4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def one_each(default: str) -> tuple[str, ...]:
    """Every architecture in the full matrix, else only ``default``."""
    return ARCHS if FULL_MATRIX else (default,)


def prompts(seed: int, count: int = 6) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(5, 120, count).long().tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 1000, (70,), generator=generator).tolist()
    return [system + torch.randint(3, 1000, (5 + 7 * i,), generator=generator).tolist() for i in range(4)]


@cache
def reference(model_dir: Path, prompts_: tuple[tuple[int, ...], ...]) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and, per step, the margin between its top two logits."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # match ignore_eos
    out = []
    for prompt in prompts_:
        result = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, output_logits=True, return_dict_in_generate=True)
        margins = [float(top[0, 0] - top[0, 1]) for top in (s.topk(2).values for s in result.logits)]
        out.append((result.sequences[0, len(prompt):].tolist(), margins))
    return out


def assert_matches_reference(model_dir: Path, prompts_: list[list[int]], got: list[list[int]]) -> None:
    """Identical up to an exact top-2 tie (either pick is right there); at most one sequence may hit one."""
    expected = reference(model_dir, tuple(map(tuple, prompts_)))
    diverged = 0
    for index, (tokens, (want, margins)) in enumerate(zip(got, expected)):
        if tokens == want:
            continue
        step = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
        assert margins[step] < TIE, (f"prompt {index} diverges from transformers at step {step} where its top-2 "
                                     f"margin is {margins[step]:.2e}, not a tie")
        diverged += 1
    assert diverged <= 1, f"{diverged} of {len(prompts_)} sequences hit ties: too many to trust"


def generate(llm: LLM, prompts_: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts_], GREEDY)]


@pytest.fixture(scope="session")
def flipped_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The Qwen checkpoints with ``norm_topk_prob`` the other way round (Mixtral always renormalises)."""
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            flipped = {"qwen3_moe": False, "qwen2_moe": True}[arch]
            built[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-flipped"), arch=arch,
                                          overrides={"norm_topk_prob": flipped})
        return built[arch]

    return build


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_layers_and_logits_match_transformers(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    model = load(model_dir)
    hf_layers = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model.layers
    sparse = ["Sparse" in type(layer.mlp).__name__ for layer in hf_layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == sparse
    assert all(isinstance(layer.mlp, MLP) for layer, is_sparse in zip(model.model.layers, sparse) if not is_sparse)
    assert {"mixtral": all(sparse), "qwen3_moe": sparse == [True, False, True, True],
            "qwen2_moe": sparse == [False, True, False, True]}[arch]
    caches = make_caches(model)
    a, b, c = make_sequences([34, 28, 15], seed=2, vocab_size=model.vocab_size)
    run_step(model, caches, [(a, 21), (b, 10)])  # chunked prefill of a
    run_step(model, caches, [(a, 12), (b, 17), (c, 14)])
    run_step(model, caches, [(c, 1), (a, 1), (b, 1)])
    for seq in (a, b, c):
        torch.testing.assert_close(torch.cat(seq.logits), reference_logits(model_dir, seq.tokens), atol=LOGIT_ATOL,
                                   rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_defaults_match_transformers(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    work = prompts(seed=1)
    with LLM(str(model_dir), dtype="float32") as llm:
        assert_matches_reference(model_dir, work, generate(llm, work))
        stats = llm.stats()
        assert stats.num_blocks_free == stats.num_blocks_total


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "mixtral"] if FULL_MATRIX else ["qwen3_moe"])
def test_norm_topk_prob_flipped_matches_transformers(arch: str, flipped_model_dir: Callable[[str], Path]) -> None:
    model_dir = flipped_model_dir(arch)
    work = prompts(seed=4, count=4)
    with LLM(str(model_dir), dtype="float32") as llm:
        block = next(layer.mlp for layer in llm.engine.model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        assert block.traits.normalize_topk == (arch == "qwen2_moe")
        assert_matches_reference(model_dir, work, generate(llm, work))


@pytest.mark.parametrize("arch", one_each("qwen2_moe"))
def test_tight_cache_preempts_and_chunks_yet_matches(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    work = prompts(seed=1)
    longest = max(len(p) for p in work) + NEW_TOKENS
    with LLM(str(model_dir), dtype="float32", num_kv_blocks=-(-longest // 16) + 2, max_num_batched_tokens=32) as llm:
        assert_matches_reference(model_dir, work, generate(llm, work))
        stats = llm.stats()
        assert stats.num_preemptions > 0
        assert stats.peak_blocks_used == stats.num_blocks_total
        assert stats.num_blocks_free == stats.num_blocks_total


@pytest.mark.parametrize("arch", one_each("mixtral"))
def test_prefix_cache_hits_yet_matches(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    work = shared_prefix_prompts(seed=2)
    with LLM(str(model_dir), dtype="float32", max_num_seqs=2) as llm:
        assert_matches_reference(model_dir, work, generate(llm, work))
        assert llm.stats().prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("arch", one_each("qwen3_moe"))
def test_beam_search_equals_transformers(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    work = shared_prefix_prompts(seed=5)[:2]
    params = SamplingParams(beam_width=3, n=3, temperature=0, max_tokens=32)  # the reference's 32 new tokens
    with LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=24) as llm:
        results = llm.generate([{"prompt_token_ids": p} for p in work], params)
        for prompt, result in zip(work, results):
            expected = beam_reference(model_dir, tuple(prompt), 3, 1.0, False, (0,))
            assert [o.token_ids for o in result.outputs] == [tokens for tokens, _ in expected]
            for output, (_, score) in zip(result.outputs, expected):
                assert output.score == pytest.approx(score, abs=1e-4)
        assert llm.stats().num_blocks_used == 0


@pytest.mark.parametrize("arch", one_each("qwen2_moe"))
def test_tensor_parallel_ranks_each_hold_a_slice_of_every_expert(arch: str,
                                                                  tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    work = prompts(seed=3, count=4)
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2) as llm:
        block = next(layer.mlp for layer in llm.engine.model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        config = llm.engine.model.config
        expert_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        assert tuple(block.w_gate_up.shape) == (block.traits.num_experts, expert_size, config.hidden_size)
        assert tuple(block.w_down.shape) == (block.traits.num_experts, config.hidden_size, expert_size // 2)
        assert_matches_reference(model_dir, work, generate(llm, work))
