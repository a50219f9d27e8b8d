"""The batched sampler: each filter restricts support, penalties follow vLLM's math, seeds are batch-independent."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedllm.worker.sampler import PenaltyState, Sampler, SamplingRow, apply_penalties, make_generator
from pagedllm.core.sampling_params import SamplingParams

VOCAB = 12
CPU = torch.device("cpu")


def row(
    params: SamplingParams | None = None,
    *,
    generator: torch.Generator | None = None,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    suppressed: tuple[int, ...] = (),
) -> SamplingRow:
    return SamplingRow(params or SamplingParams(), generator, PenaltyState(prompt, output), suppressed)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draw_many(logits: torch.Tensor, params: SamplingParams, draws: int, seed: int = 1) -> Counter[int]:
    """``draws`` samples of one logits row, taken as one batch of identical rows."""
    torch.manual_seed(seed)
    batch = logits.unsqueeze(0).expand(draws, -1).contiguous()
    return Counter(t.token_id for t in Sampler()(batch, [row(params)] * draws))


def test_greedy_is_argmax_and_ties_pick_lowest_id() -> None:
    logits = random_logits(4)
    logits[3] = 0.0
    logits[3, 5] = logits[3, 9] = 7.0
    tokens = Sampler()(logits, [row(SamplingParams(temperature=0.0))] * 4)
    assert [t.token_id for t in tokens] == logits[:3].argmax(dim=-1).tolist() + [5]


def test_greedy_picks_what_torch_argmax_picks_with_infinities_and_nans() -> None:
    logits = random_logits(4)
    logits[0, 2] = logits[0, 7] = float("nan")
    logits[1] = float("-inf")
    logits[2, 4] = logits[2, 9] = float("inf")
    tokens = Sampler()(logits, [row(SamplingParams(temperature=0.0))] * 4)
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist() == [2, 0, 4, logits[3].argmax().item()]


def test_sampler_does_not_modify_caller_logits() -> None:
    logits = random_logits(2)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.5)
    Sampler()(logits, [row(params, prompt=(1, 2), suppressed=(3,)), row(SamplingParams(temperature=0.0))])
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=5.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
        SamplingParams(temperature=5.0, min_p=1.0),
    ],
    ids=["top_k=1", "top_p tiny", "min_p=1"],
)
def test_tightest_filter_equals_greedy(params: SamplingParams) -> None:
    logits = random_logits(6, seed=3)
    torch.manual_seed(0)
    tokens = Sampler()(logits, [row(params)] * 6)
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_samples_within_the_k_largest() -> None:
    logits = random_logits(1, seed=4)[0]
    allowed = set(logits.topk(3).indices.tolist())
    counts = draw_many(logits, SamplingParams(temperature=50.0, top_k=3), 600)
    assert set(counts) == allowed  # high temperature: all three appear, nothing else does


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]))
    counts = draw_many(logits, SamplingParams(top_p=0.7), 600)
    assert set(counts) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.19, 0.11]))
    counts = draw_many(logits, SamplingParams(min_p=0.5), 600)  # threshold 0.2
    assert set(counts) == {0, 1}


def test_suppressed_ids_are_never_chosen() -> None:
    logits = random_logits(1, seed=5)[0]
    best = int(logits.argmax())
    greedy = Sampler()(logits.unsqueeze(0), [row(SamplingParams(temperature=0.0), suppressed=(best,))])
    assert greedy[0].token_id != best
    torch.manual_seed(2)
    batch = logits.unsqueeze(0).expand(400, -1).contiguous()
    sampled = Sampler()(batch, [row(SamplingParams(temperature=3.0), suppressed=(best, 0))] * 400)
    assert not {best, 0} & {t.token_id for t in sampled}


def test_suppressed_id_outside_vocabulary_is_rejected() -> None:
    with pytest.raises(ValueError, match="suppressed_token_ids"):
        Sampler()(random_logits(1), [row(suppressed=(VOCAB,))])


def test_logits_shape_must_match_rows() -> None:
    with pytest.raises(ValueError, match="logits must have shape"):
        Sampler()(random_logits(2), [row()])


def penalized_logits(logits: torch.Tensor, params: SamplingParams, prompt: tuple[int, ...],
                     output: tuple[int, ...]) -> torch.Tensor:
    work = logits.clone().unsqueeze(0)
    apply_penalties(work, [row(params, prompt=prompt, output=output)])
    return work[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0, 4.0])
    result = penalized_logits(logits, SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1, 1))
    assert result.tolist() == [1.0, -4.0, 3.0, -1.0, 4.0]


def test_frequency_and_presence_penalties_use_output_counts_only() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    result = penalized_logits(logits, params, prompt=(3,), output=(0, 0, 0, 1))
    assert result.tolist() == pytest.approx([1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0, 1.0])


def test_penalties_steer_greedy_choice_per_row() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    rows = [
        row(SamplingParams(temperature=0.0, frequency_penalty=2.0), output=(0,)),
        row(SamplingParams(temperature=0.0), output=(0,)),
    ]
    assert [t.token_id for t in Sampler()(logits, rows)] == [1, 0]


def test_seeded_rows_are_independent_of_batch_composition_and_order() -> None:
    logits = random_logits(5, seed=6)
    seeded = SamplingParams(temperature=1.5, top_k=8, seed=42)

    def run(order: list[int], others: SamplingParams) -> dict[int, int]:
        sampled: dict[int, list[int]] = {i: [] for i in order}
        generators = {i: make_generator(42, i, CPU) for i in order}
        torch.manual_seed(sum(order) + len(order))
        for _ in range(20):
            rows = [row(seeded, generator=generators[i]) if i < 3 else row(others) for i in order]
            for i, token in zip(order, Sampler()(logits[order], rows)):
                sampled[i].append(token.token_id)
        return {i: tuple(sampled[i]) for i in order if i < 3}

    alone = run([0, 1, 2], SamplingParams())
    mixed = run([4, 2, 3, 0, 1], SamplingParams(temperature=0.0))
    shuffled = run([1, 3, 0, 4, 2], SamplingParams(temperature=2.0, top_p=0.5))
    assert alone == mixed == shuffled


def test_make_generator_separates_samples_and_is_reproducible() -> None:
    assert make_generator(None, 0, CPU) is None
    draws = {}
    for index in (0, 1, 0):
        generator = make_generator(7, index, CPU)
        assert generator is not None
        draws.setdefault(index, []).append(torch.rand(8, generator=generator).tolist())
    assert draws[0][0] == draws[0][1]
    assert draws[0][0] != draws[1][0]
    with pytest.raises(ValueError, match="sample_index"):
        make_generator(7, -1, CPU)


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    logits = random_logits(3, seed=8)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=3.0), prompt=(0, 1, 2)),
        row(SamplingParams(temperature=0.8, logprobs=0)),
        row(SamplingParams(temperature=0.8)),
    ]
    tokens = Sampler()(logits, rows)
    reference = logits.log_softmax(dim=-1)
    for i, token in enumerate(tokens[:2]):
        assert token.logprob == pytest.approx(reference[i, token.token_id].item(), abs=1e-5)
    assert tokens[2].logprob is None  # not asked for: no log_softmax over its row
    top3 = reference[0].topk(3)
    expected = dict(zip(top3.indices.tolist(), top3.values.tolist()))
    expected[tokens[0].token_id] = reference[0, tokens[0].token_id].item()
    assert tokens[0].top_logprobs == pytest.approx(expected, abs=1e-5)
    assert tokens[1].top_logprobs == pytest.approx({tokens[1].token_id: tokens[1].logprob})
    assert tokens[2].top_logprobs is None


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sample_frequencies_follow_tempered_probabilities(temperature: float) -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    expected = (probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()).tolist()
    draws = 2000
    counts = draw_many(torch.log(probs), SamplingParams(temperature=temperature), draws, seed=11)
    for token, p in enumerate(expected):
        stddev = math.sqrt(draws * p * (1 - p))
        assert abs(counts[token] - draws * p) < 5 * stddev


def test_empty_batch_returns_nothing() -> None:
    assert Sampler()(torch.empty(0, VOCAB), []) == []


@pytest.mark.parametrize("temperature", [1e-30, 1e-6])
def test_a_temperature_that_would_overflow_samples_greedily(temperature: float) -> None:
    logits = random_logits(3) * 1e3
    tokens = Sampler()(logits, [row(SamplingParams(temperature=temperature, logprobs=0))] * 3)
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert all(t.logprob is not None and math.isfinite(t.logprob) for t in tokens)
