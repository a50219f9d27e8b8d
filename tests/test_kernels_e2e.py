"""End to end: the engine on the Triton-lang kernels (CPU interpreter) samples the same
tokens as on the torch references."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import pagedllm.kernels
from pagedllm import LLM, SamplingParams

NEW_TOKENS = 8


def _generate(model_dir: Path, backend: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    # A 16-token step budget splits the longer prompts into chunks that start mid-sequence,
    # running alongside other requests' decodes.
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", attention_backend=backend,
              max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total
    return [[sample.token_ids for sample in out.outputs] for out in outs]


def test_triton_kernels_generate_the_reference_tokens(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_dir("qwen3")  # explicit head_dim, q/k norms, GQA
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (5, 21, 38)]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # Two seeded samples of one prompt share its blocks, so the fork goes through copy_blocks.
    forked = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, n=2, seed=7, ignore_eos=True)
    params = [greedy, greedy, forked]
    expected = _generate(model_dir, "torch", prompts, params)
    unified_attention, write_kv, copy_blocks = pagedllm.kernels.triton_backend_ops()
    copies: list[torch.Tensor] = []

    def counted_copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_mapping: torch.Tensor) -> None:
        copies.append(block_mapping.clone())
        copy_blocks(kv_caches, block_mapping)

    monkeypatch.setattr(pagedllm.kernels, "triton_backend_ops",
                        lambda: (unified_attention, write_kv, counted_copy_blocks))
    actual = _generate(model_dir, "triton", prompts, params)
    assert sum(mapping.shape[0] for mapping in copies) > 0
    assert all(len(sample) == NEW_TOKENS for out in actual for sample in out)
    assert actual == expected
