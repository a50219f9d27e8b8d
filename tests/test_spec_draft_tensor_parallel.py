"""A draft model at tensor_parallel_size=2: the draft runs unsharded on rank 0 only (proposals on rank 0),
the target verifies on every rank through the ordinary step broadcast (the drafts travel as scheduled tokens).

The exactness case starts a worker process and loads two models, so ``pytest --full`` runs it; the default
run keeps a killed worker rank during draft speculation, which must end the requests with ``WorkerDied``
naming rank 1, as without speculation.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_spec_decode_exactness import GREEDY, K, assert_same, random_prompts, run
from test_spec_draft_model import NOISE, assert_speculated

from pagedllm import LLM, SamplingParams
from pagedllm.executor.workers import WorkerDied
from pagedllm.testing.draft_checkpoint import noisy_draft
from pagedllm.worker.model_runner import ModelRunner

BUDGET_GB = 0.01  # a small fixed KV budget per rank, so the block count can be checked exactly


@pytest.fixture(scope="module")
def llama_draft(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return noisy_draft(tiny_model_dir("llama"), tmp_path_factory.mktemp("draft-tp-llama"), NOISE)


def draft_at_tp2(model_dir: Path, draft: Path, **engine_args: object) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", tensor_parallel_size=2, **engine_args, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": K, "disable_by_batch_size": 0,
        "draft_confidence_threshold": 0})


@pytest.mark.full
def test_greedy_with_a_draft_model_at_tp2_equals_tp1_without_speculation(
        tiny_model_dir: Callable[[str], Path], llama_draft: Path) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(seed=1)[:4]
    params = replace(GREEDY, logprobs=2)
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, params)
    with draft_at_tp2(model_dir, llama_draft, kv_cache_memory_gb=BUDGET_GB) as llm:
        assert_same(run(llm, prompts, params), want)
        assert_speculated(llm)
        engine = llm.engine
        assert engine.model.tp.size == 2
        draft_runner = engine.speculative.draft.runner
        assert draft_runner.model.tp.size == 1  # the whole draft, on rank 0 only
        # Rank 0 holds its share of the target's K/V and all of the draft's in every block; the worker holds
        # only its share, and the block count both were sent is rank 0's (the ranks' budget is the same). The
        # draft's caches are in its own dtype (draft_dtype: bfloat16 where the CPU computes it natively).
        per_block = (ModelRunner.bytes_per_block(engine.model, 16, torch.float32)
                     + ModelRunner.bytes_per_block(draft_runner.model, 16, draft_runner.kv_caches[0][0].dtype))
        assert llm.stats().num_blocks_total == int(BUDGET_GB * (1 << 30)) // per_block


def test_a_killed_worker_during_draft_speculation_fails_naming_its_rank(
        tiny_model_dir: Callable[[str], Path], llama_draft: Path) -> None:
    llm = draft_at_tp2(tiny_model_dir("llama"), llama_draft)
    try:
        prompt = {"prompt_token_ids": random_prompts(seed=5)[0]}
        llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        counts = llm.engine.stats().spec_decode
        assert counts is not None and counts.num_drafts > 0  # the draft proposed before the worker died
        (worker,) = llm.engine.workers.pids()
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=rf"rank 1 \(pid {worker}\) was killed by SIGKILL"):
            llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
