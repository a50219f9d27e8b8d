"""Speculative decoding with a draft model (``method: draft_model``): greedy tokens equal those without
speculation, sampled ones keep the target's distribution, and a draft that cannot serve the target
fails the load naming the field.

The draft is the target's own checkpoint with a little noise (``pagedllm.testing.draft_checkpoint``):
it agrees with the target about half the time, so drafts are accepted and rejected at every position,
through the real proposer (its K/V in caches of its own, indexed by the target's block tables),
the scheduler's lookahead slots and the rejection sampler. Exactness cannot show a draft that guesses
wrong after its first position (the target verifies every draft); the target as its own draft can: every
draft is then accepted.

By default llama runs the tight-pool case (preemption asserted, logprobs); ``pytest --full`` adds
prefix hits, ``n = 2`` with penalties and stops inside accepted runs, and qwen3.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import full_run
import pytest
import torch
from test_spec_decode_distribution import SAMPLES, chi_square_p, first_three
from test_spec_decode_exactness import GREEDY, K, NEW_TOKENS, assert_same, random_prompts, run

from pagedllm import LLM, SamplingParams
from pagedllm.core.speculative_config import ACCEPTANCE_RATE_MIN_DRAFTS
from pagedllm.testing.draft_checkpoint import noisy_draft

FULL = full_run.full()
# Noise that makes the tiny random models' draft agree with the target on about 40% of greedy tokens.
NOISE = 0.01


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
              ) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            built[arch] = noisy_draft(tiny_model_dir(arch), tmp_path_factory.mktemp(f"draft-{arch}"), NOISE)
        return built[arch]

    return build


def with_draft(model_dir: Path, draft: Path, threshold: float = 0.0, draft_dtype: str | None = None,
               **engine_args: object) -> LLM:
    """A tiny random model's draft is rarely confident (its softmax is nearly flat): the cases drafting all ``K``
    at every step pin the confidence threshold to 0. ``draft_dtype`` unset: the default, bfloat16 on a CPU that
    computes it natively, float32 elsewhere."""
    return LLM(model=str(model_dir), dtype="float32", **engine_args, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": K, "disable_by_batch_size": 0,
        "draft_confidence_threshold": threshold, "draft_dtype": draft_dtype})


def assert_speculated(llm: LLM) -> None:
    counts = llm.engine.stats().spec_decode
    assert counts is not None and 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert counts.num_accepted_tokens_per_pos[-1] > 0  # whole runs accepted too
    assert sum(counts.num_accepted_tokens_per_pos) == counts.num_accepted_tokens
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def case_tight_pool_with_logprobs(model_dir: Path, draft: Path) -> None:
    prompts = random_prompts(seed=1)
    params = replace(GREEDY, logprobs=3)
    tight = {"num_kv_blocks": -(-(150 + NEW_TOKENS + 2 * K) // 16) + 2, "max_num_batched_tokens": 32}
    want = run(LLM(model=str(model_dir), dtype="float32", **tight), prompts, params)
    llm = with_draft(model_dir, draft, **tight)
    assert_same(run(llm, prompts, params), want)
    assert llm.stats().num_preemptions > 0
    assert_speculated(llm)


def case_prefix_hits(model_dir: Path, draft: Path) -> None:
    generator = torch.Generator().manual_seed(2)
    system = torch.randint(3, 1000, (70,), generator=generator).tolist()
    prompts = [system + torch.randint(3, 1000, (5 + 7 * i,), generator=generator).tolist() for i in range(5)]
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    llm = with_draft(model_dir, draft, max_num_seqs=2)
    assert_same(run(llm, prompts, GREEDY), want)
    assert llm.stats().prefix_cache_hit_tokens > 0
    assert_speculated(llm)


def case_two_samples_with_penalties_and_stops(model_dir: Path, draft: Path) -> None:
    prompts = random_prompts(seed=3)[:3] + [[token] * 30 for token in (17, 321)]
    full = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    text = full[1][0].text
    params = replace(GREEDY, n=2, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                     stop_token_ids=(full[0][0].token_ids[17],), stop=(text[len(text) // 2 : len(text) // 2 + 3],),
                     min_tokens=2)
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, params)
    llm = with_draft(model_dir, draft)
    assert_same(run(llm, prompts, params), want)
    assert_speculated(llm)


CASES = {
    "tight_pool_logprobs": case_tight_pool_with_logprobs,
    "prefix_hits": case_prefix_hits,
    "n2_penalties_stops": case_two_samples_with_penalties_and_stops,
}
MATRIX = [(arch, name) for arch in ("llama", "qwen3") for name in CASES
          if FULL or (arch, name) == ("llama", "tight_pool_logprobs")]


@pytest.mark.parametrize(("arch", "case"), MATRIX)
def test_greedy_with_a_draft_model_equals_without(arch: str, case: str, tiny_model_dir: Callable[[str], Path],
                                                  draft_dir: Callable[[str], Path]) -> None:
    CASES[case](tiny_model_dir(arch), draft_dir(arch))


@pytest.mark.full
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_first_three_tokens_follow_the_target_distribution(tiny_model_dir: Callable[[str], Path],
                                                           tmp_path: Path, threshold: float) -> None:
    """As the n-gram test (test_spec_decode_distribution), with drafts drawn from the draft's own q and
    verified by rejection sampling. The draft is noisier there: at temperature 0.5 its q must differ
    from p enough for rejections to matter. At threshold 0.3 (about the median q of a drawn draft here)
    a run's length depends on what the draft drew, which must not bias what the target keeps."""
    model_dir = tiny_model_dir("llama")
    draft = noisy_draft(model_dir, tmp_path / "draft", 0.02)
    plain = LLM(model=str(model_dir), dtype="float32", max_num_seqs=256)
    want = first_three(plain, range(SAMPLES))
    llm = with_draft(model_dir, draft, threshold, max_num_seqs=256)
    got = first_three(llm, range(SAMPLES, 2 * SAMPLES))
    counts = llm.engine.stats().spec_decode
    assert counts is not None
    accepted = counts.num_accepted_tokens_per_pos
    assert counts.num_drafts > SAMPLES and 100 < accepted[1] < accepted[0] < counts.num_drafts - 100
    if threshold:
        assert counts.num_draft_tokens < K * counts.num_drafts - 100  # runs were cut by what the draft drew
    for name, pick in (("joint", lambda t: t), ("t1", lambda t: t[0]), ("t2", lambda t: t[1]), ("t3", lambda t: t[2])):
        p = chi_square_p([pick(t) for t in got], [pick(t) for t in want])
        assert p > 1e-3, f"{name}: the speculative samples differ from the target's (chi-square p={p:.2e})"


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_model_dir: Callable[[str], Path]) -> None:
    """The exactness tests cannot see a draft that guesses wrong after its first position (the target
    verifies every draft); a draft equal to the target can: all its greedy guesses are the target's tokens, so
    every draft at every position is accepted, through preemption (draft state dropped and rebuilt) and
    prefix-cache hits (the draft recomputes the shared prefix)."""
    model_dir = tiny_model_dir("llama")
    generator = torch.Generator().manual_seed(11)
    system = torch.randint(3, 1000, (40,), generator=generator).tolist()
    prompts = [system + torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (3, 60, 70)]
    tight = {"num_kv_blocks": -(-(110 + NEW_TOKENS + 2 * K) // 16) + 1, "max_num_seqs": 2}
    llm = with_draft(model_dir, model_dir, draft_dtype="float32", **tight)  # the target's own arithmetic
    run(llm, prompts, GREEDY)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    counts = llm.engine.stats().spec_decode
    assert counts is not None
    assert counts.num_accepted_tokens == counts.num_draft_tokens
    assert counts.num_accepted_tokens_per_pos[0] == counts.num_drafts
    # Runs shorter than K only where a sequence nears max_tokens or lacks lookahead room: few of them.
    assert counts.num_accepted_tokens_per_pos[K - 1] >= counts.num_drafts - 2 * len(prompts)


@pytest.mark.parametrize("draft_dtype", ["bfloat16", "float32"])
def test_the_draft_runs_in_draft_dtype_and_greedy_stays_the_targets(tiny_model_dir: Callable[[str], Path],
                                                                     draft_dir: Callable[[str], Path],
                                                                     draft_dtype: str) -> None:
    """A float32 target's draft in bfloat16 (the default where the CPU computes it natively): its weights and
    its K/V caches are bfloat16, and the target's verification keeps the greedy tokens exact."""
    model_dir, draft = tiny_model_dir("llama"), draft_dir("llama")
    prompts = random_prompts(seed=13)[:3]
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    llm = with_draft(model_dir, draft, draft_dtype=draft_dtype)
    assert_same(run(llm, prompts, GREEDY), want)
    assert_speculated(llm)
    assert llm.engine.speculative is not None and llm.engine.speculative.draft is not None
    runner = llm.engine.speculative.draft.runner
    dtype = getattr(torch, draft_dtype)
    assert runner.model.model.embed_tokens.weight.dtype == dtype
    assert runner.kv_caches[0][0].dtype == dtype
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float32


def edited(source: Path, out: Path, edit: Callable[[Path], None]) -> Path:
    noisy_draft(source, out, 0.0)
    edit(out)
    return out


def set_config(key: str, value: int) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, key: value}))
    return edit


def swap_two_tokens(path: Path) -> None:
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    (a, i), (b, j) = list(vocab.items())[300:302]
    vocab[a], vocab[b] = j, i
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.mark.parametrize(("edit", "message"), [
    (set_config("vocab_size", 77), "has vocab_size 77"),
    (swap_two_tokens, "has a tokenizer different from the target's"),
    (set_config("max_position_embeddings", 64), "allows contexts of 64 tokens, fewer than the target's max_model_len"),
])
def test_a_draft_that_cannot_serve_the_target_fails_the_load(tiny_model_dir: Callable[[str], Path], tmp_path: Path,
                                                             edit: Callable[[Path], None], message: str) -> None:
    model_dir = tiny_model_dir("llama")
    draft = edited(model_dir, tmp_path / "draft", edit)
    with pytest.raises(ValueError, match="speculative_config.model=") as error:
        with_draft(model_dir, draft)
    assert message in str(error.value)


def test_other_refusals_name_the_field(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="speculative_config.model is required with method 'draft_model'"):
        LLM(model=model_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens=0"):
        LLM(model=model_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 0,
                                                 "model": model_dir})


def test_sampled_drafts_are_verified_by_rejection(tiny_model_dir: Callable[[str], Path],
                                                  draft_dir: Callable[[str], Path]) -> None:
    """A sampled request verifies with the draft's q (not the one-hot path): some drafts accepted, some not,
    and a seeded request is reproducible."""
    model_dir, draft = tiny_model_dir("llama"), draft_dir("llama")
    prompts = random_prompts(seed=7)[:2]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=1)
    first, again = (run(with_draft(model_dir, draft), prompts, params) for _ in range(2))
    assert first == again
    llm = with_draft(model_dir, draft)
    run(llm, prompts, params)
    counts = llm.engine.stats().spec_decode
    assert counts is not None and 0 < counts.num_accepted_tokens < counts.num_draft_tokens


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_a_doubted_guess_is_the_last_of_its_step(tiny_model_dir: Callable[[str], Path],
                                                 draft_dir: Callable[[str], Path], params: SamplingParams) -> None:
    """At threshold 1 every guess is doubted (the draft never gives one probability 1), so each verification holds
    exactly one draft, verified exactly as a whole run would be: greedy tokens equal those without speculation,
    and sampled drafts still go through rejection (some accepted, some not)."""
    model_dir, draft = tiny_model_dir("llama"), draft_dir("llama")
    prompts = random_prompts(seed=5)[:3]
    llm = with_draft(model_dir, draft, threshold=1.0)
    got = run(llm, prompts, params)
    if params.greedy:
        assert_same(got, run(LLM(model=str(model_dir), dtype="float32"), prompts, params))
    counts = llm.engine.stats().spec_decode
    assert counts is not None and counts.num_drafts > 0
    assert counts.num_draft_tokens == counts.num_drafts
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens


def test_a_request_below_disable_by_acceptance_rate_stops_proposing(tiny_model_dir: Callable[[str], Path],
                                                                      draft_dir: Callable[[str], Path]) -> None:
    """The draft agrees about 40% of the time: a 0.9 floor turns each request's speculation off once it has
    been measured over ACCEPTANCE_RATE_MIN_DRAFTS drafted tokens; a 0.1 floor never does. Tokens are unchanged."""
    model_dir, draft = tiny_model_dir("llama"), draft_dir("llama")
    prompts = random_prompts(seed=9)[:3]
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    drafted = {}
    for floor in (0.9, 0.1):
        llm = LLM(model=str(model_dir), dtype="float32", speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": K, "disable_by_batch_size": 0,
            "disable_by_acceptance_rate": floor, "draft_confidence_threshold": 0})
        assert_same(run(llm, prompts, GREEDY), want)
        counts = llm.engine.stats().spec_decode
        assert counts is not None
        drafted[floor] = counts.num_draft_tokens
    # A request is measured at its verification and proposes nothing after it: at most K - 1 past the minimum.
    bound = len(prompts) * (ACCEPTANCE_RATE_MIN_DRAFTS + K - 1)
    assert drafted[0.9] <= bound < drafted[0.1]


def test_the_default_model_speculates_with_its_shipped_draft() -> None:
    """float32: in bfloat16 (``auto`` on a CPU with native bf16) the multi-token verifying forward rounds
    differently from one-token decode, and this prompt's 17th token is a near-tie that flips."""
    prompt = "import os\n\n\ndef read_lines(path):\n"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # float32: in bfloat16 the verifying forward (prefill-shaped) and a decode step round differently,
    # so near-ties may flip, as in any engine; the token-exact property is float32's.
    want = LLM(dtype="float32").generate(prompt, params)[0].outputs[0].token_ids
    llm = LLM(dtype="float32", speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
    counts = llm.engine.stats().spec_decode
    assert counts is not None and counts.num_drafts > 0
    # The default confidence threshold ended some runs early and let others run to more than one draft.
    assert counts.num_drafts < counts.num_draft_tokens < 3 * counts.num_drafts
