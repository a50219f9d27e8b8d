"""The n-gram (prompt lookup) proposer: the longest earlier suffix match, its latest occurrence, the limits,
and the incremental suffix indexes, checked against a brute-force search on random contexts, whole and grown
piece by piece."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.worker.ngram_proposer import NgramProposer, SuffixIndex


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    index = SuffixIndex(min_n, max_n)
    index.extend(tokens)
    return index.propose(tokens, k)


def test_the_longest_suffix_wins_then_its_latest_occurrence() -> None:
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3]
    # "1 2 3" occurred at 0 (then 9 9 2); "2 3" alone occurred later at 5 (then 7 7 1): three tokens match first.
    assert lookup(tokens, 1, 3, 3) == [9, 9, 2]
    assert lookup(tokens, 1, 2, 3) == [7, 7, 1]  # with at most 2, the latest "2 3" wins
    assert lookup(tokens, 4, 5, 3) == []  # no 4-token suffix occurred before
    assert lookup(tokens, 1, 3, 1) == [9]


def test_a_proposal_may_run_into_the_suffix_itself_and_stops_at_the_end() -> None:
    assert lookup([5, 6, 5, 6, 5], 1, 2, 4) == [6, 5]
    assert lookup([4, 4, 4], 1, 1, 5) == [4]
    assert lookup([4], 1, 1, 5) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 4), st.integers(0, 3), st.integers(1, 5))
def test_matches_brute_force(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    assert lookup(tokens, min_n, min_n + extra, k) == brute_force(tokens, min_n, min_n + extra, k)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=50), st.lists(st.integers(1, 6), min_size=1, max_size=12),
       st.integers(1, 3), st.integers(0, 3))
def test_an_index_grown_piece_by_piece_matches_brute_force(tokens: list[int], pieces: list[int], min_n: int,
                                                            extra: int) -> None:
    index = SuffixIndex(min_n, min_n + extra)
    end = 0
    for piece in pieces:  # the engine appends one token, or an accepted run, per step
        end = min(end + piece, len(tokens))
        index.extend(tokens[:end])
        assert index.propose(tokens[:end], 4) == brute_force(tokens[:end], min_n, min_n + extra, 4)


def sequence(tokens: list[int], prompt_len: int):
    request = Request("r", None, tuple(tokens[:prompt_len]), SamplingParams())
    return request.spawn(list(tokens))


def test_the_proposer_mirrors_growing_sequences_and_respects_each_limit() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    a = sequence([1, 2, 3, 4, 5, 1, 2], 5)
    b = sequence([7, 8, 7], 3)
    assert proposer.propose([a, b], [5, 5]) == [[3, 4, 5], []]
    a.token_ids += [3, 4, 5, 1, 2, 3] * 50  # grows by many tokens at once
    b.token_ids += [8]
    assert proposer.propose([a, b], [2, 0]) == [[3, 4], []]  # a's limit 2; b's limit 0 proposes nothing
    assert proposer.propose([b], [5]) == [[7, 8]]
    proposer.release([a.seq_id, b.seq_id])
    assert proposer.propose([a], [3]) == [[3, 4, 5]]  # rebuilt from scratch after a release


def test_bad_lookup_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)
