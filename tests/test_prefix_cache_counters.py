"""The prefix-cache counters behind ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``,
counted as vLLM counts them (``PrefixCacheStats.record`` at admission): a request's tokens and the tokens its
cached blocks cover, once, when it is first admitted; a re-admission after preemption and a prompt-logprobs
request (which skips the cache) count nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine

BLOCK_SIZE = 4


def finish(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int, **params: object) -> None:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                              **params))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture
def engine(tiny_model_dir: Callable[[str], Path]) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", device="cpu",
                                    block_size=BLOCK_SIZE, num_kv_blocks=12, max_num_seqs=4,
                                    max_num_batched_tokens=64, engine_process=False))
    yield engine
    engine.close()


def test_each_request_is_one_query_at_its_first_admission_and_preemptions_add_none(engine: LLMEngine) -> None:
    # Four requests of 7 blocks each in a 12-block pool: they preempt one another, and a preempted request,
    # admitted again, finds its own freed blocks still cached: vLLM counts neither its tokens nor those hits.
    distinct = {f"r{i}": list(range(100 * (i + 1), 100 * (i + 1) + 10)) for i in range(4)}
    finish(engine, distinct, max_tokens=16)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    stats = engine.stats()
    assert stats.prefix_cache_queried_tokens == 4 * 10  # the prompts, each once
    assert stats.prefix_cache_hit_tokens == 0  # no prompt shares a block with another

    shared = list(range(900, 912))  # 3 blocks; the last token is never matched: 2 blocks hit
    finish(engine, {"first": shared}, max_tokens=2)
    finish(engine, {"again": shared, "longer": shared + [1, 2, 3]}, max_tokens=2)
    stats = engine.stats()
    assert stats.prefix_cache_queried_tokens == 40 + 12 + 12 + 15
    assert stats.prefix_cache_hit_tokens == 2 * BLOCK_SIZE + 3 * BLOCK_SIZE

    finish(engine, {"logprobs": shared}, max_tokens=1, prompt_logprobs=0)  # skips the cache: not a query
    assert (engine.stats().prefix_cache_queried_tokens, engine.stats().prefix_cache_hit_tokens) == (79, 20)
