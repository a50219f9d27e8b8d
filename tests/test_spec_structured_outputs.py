"""Structured outputs with speculation: drafts are cut at the first token the grammar refuses, each verified
position is masked as its drafts leave the grammar, and the matcher rolls back to the accepted run. Greedy
tokens, text and finish reasons equal those without speculation, with the draft model and with n-gram
proposals (an oracle that corrupts a quarter of the known continuation, so refused drafts occur;
``pytest --full`` runs that one)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import full_run
import pytest
from test_spec_decode_exactness import OracleProposer, Result, assert_same, continuations_of, random_prompts, run

from pagedllm import LLM, SamplingParams
from pagedllm.testing.draft_checkpoint import noisy_draft
from pagedllm.testing.structured_corpus import JSON_SCHEMAS, REGEXES

FULL = full_run.full()
CONSTRAINTS = [{"json": JSON_SCHEMAS[0]}, {"json": JSON_SCHEMAS[3]}, {"regex": REGEXES[0]}]


@pytest.mark.parametrize("method", ["draft_model", *(["ngram"] if FULL else [])])
def test_greedy_structured_outputs_with_speculation_equal_without(method: str, tiny_model_dir: Callable[[str], Path],
                                                                  tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(seed=8, lengths=(9, 30, 51))
    want, params = [], []
    plain = LLM(model=str(model_dir), dtype="float32")
    for prompt, constraint in zip(prompts, CONSTRAINTS):
        params.append(SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=constraint))
        want += run(plain, [prompt], params[-1])
    config: dict[str, object] = {"method": method, "num_speculative_tokens": 4, "disable_by_batch_size": 0}
    if method == "draft_model":
        config["model"] = str(noisy_draft(model_dir, tmp_path / "draft", 0.01))
        config["draft_confidence_threshold"] = 0  # the tiny model's flat softmax would end most runs at one draft
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=config)
    assert llm.engine.speculative is not None
    if method == "ngram":
        llm.engine.speculative.proposer = OracleProposer(continuations_of(prompts, want))  # type: ignore[assignment]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [[Result(tuple(c.token_ids), c.text, c.finish_reason, None) for c in out.outputs] for out in outs]
    assert_same(got, want)
    counts = llm.engine.stats().spec_decode
    assert counts is not None and counts.num_accepted_tokens > 0
    if method == "draft_model":
        assert counts.num_accepted_tokens < counts.num_draft_tokens
