"""Sampling with speculation keeps the target distribution: the first three generated tokens of 2000 seeded
samples (temperature 0.5, top-k, presence penalty) against 2000 (other seeds) from the engine without speculation.

Drafts come from a proposer that guesses, after the first token, the continuation most often seen after
it in a pilot run: right about half the time, so acceptances, rejections at either drafted position and
bonus tokens all occur. The two samples are compared with Pearson's two-sample chi-square test on the
joint (t1, t2, t3) and on each position's marginal, categories seen fewer than 10 times in both samples
together pooled into one; each must have p > 1e-3 (p from the Wilson-Hilferty approximation of the
chi-square distribution). The samples are seeded, so the test is deterministic; a verifier that accepted
every draft fails it with p < 1e-12.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import Sample as EngineSequence

SAMPLES = 2000
PROMPT = list(range(100, 117))  # one full block, then a token: the prompt is computed once and then cached
MIN_POOLED_COUNT = 10


def params(seeds: range) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=4, temperature=0.5, top_k=40, presence_penalty=0.5, ignore_eos=True, seed=seed)
            for seed in seeds]


def first_three(llm: LLM, seeds: range) -> list[tuple[int, ...]]:
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(seeds), params(seeds))
    return [tuple(out.outputs[0].token_ids[:3]) for out in outs]


class PilotProposer:
    """After the first token, the (t2, t3) seen most often after it in the pilot; nothing otherwise."""

    def __init__(self, pilot: list[tuple[int, ...]]) -> None:
        after: dict[int, Counter[tuple[int, ...]]] = {}
        for t1, *rest in pilot:
            after.setdefault(t1, Counter())[tuple(rest)] += 1
        self.guess = {t1: list(counts.most_common(1)[0][0]) for t1, counts in after.items()}

    def propose(self, seqs: Sequence[EngineSequence], max_tokens: Sequence[int]) -> list[list[int]]:
        return [self.guess.get(seq.output_token_ids[0], [])[:limit] if seq.num_output_tokens == 1 else []
                for seq, limit in zip(seqs, max_tokens)]

    def release(self, seq_ids: object) -> None:
        pass


def chi_square_p(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """p-value of Pearson's two-sample chi-square test that ``a`` and ``b`` come from one distribution."""
    count_a, count_b = Counter(a), Counter(b)
    pooled_a = pooled_b = 0
    cells: list[tuple[int, int]] = []
    for key in count_a.keys() | count_b.keys():
        x, y = count_a[key], count_b[key]
        if x + y < MIN_POOLED_COUNT:
            pooled_a, pooled_b = pooled_a + x, pooled_b + y
        else:
            cells.append((x, y))
    cells.append((pooled_a, pooled_b))
    total_a, total_b = len(a), len(b)
    statistic = 0.0
    for x, y in cells:
        expected_a = (x + y) * total_a / (total_a + total_b)
        expected_b = (x + y) * total_b / (total_a + total_b)
        if x + y:
            statistic += (x - expected_a) ** 2 / expected_a + (y - expected_b) ** 2 / expected_b
    df = len(cells) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_first_three_tokens_follow_the_target_distribution(tiny_model_dir: Callable[[str], Path]) -> None:
    model = str(tiny_model_dir("llama"))
    plain = LLM(model=model, dtype="float32", max_num_seqs=256)
    pilot = first_three(plain, range(2 * SAMPLES, 2 * SAMPLES + 500))
    want = first_three(plain, range(SAMPLES))
    llm = LLM(model=model, dtype="float32", max_num_seqs=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0})
    assert llm.engine.speculative is not None
    llm.engine.speculative.proposer = PilotProposer(pilot)  # type: ignore[assignment]
    # Other seeds: a seeded sample draws the same noise with and without speculation until a draft is rejected,
    # so equal seeds would make the two samples nearly identical rather than independent.
    got = first_three(llm, range(SAMPLES, 2 * SAMPLES))

    counts = llm.engine.stats().spec_decode
    assert counts is not None
    accepted = counts.num_accepted_tokens_per_pos
    # Both drafted positions are accepted and rejected many times.
    assert counts.num_drafts > SAMPLES // 2 and 200 < accepted[1] < accepted[0] < counts.num_drafts - 200
    for name, pick in (("joint", lambda t: t), ("t1", lambda t: t[0]), ("t2", lambda t: t[1]), ("t3", lambda t: t[2])):
        p = chi_square_p([pick(t) for t in got], [pick(t) for t in want])
        assert p > 1e-3, f"{name}: the speculative samples differ from the target's (chi-square p={p:.2e})"
