"""A draft that scores only part of the vocabulary (``draft_vocab.safetensors`` beside its checkpoint):
its LM head is cut to those rows, it proposes only those tokens, greedy tokens still equal those without
speculation, sampled drafts carry a ``q`` that is zero outside the subset (so rejection sampling keeps
the target's distribution), and a bad vocabulary file fails the load naming the file.

The draft is a noisy copy of the tiny target (``pagedllm.testing.draft_checkpoint``); its vocabulary is the
tokens the target emits on the test's prompts plus every other token of the rest, so drafts are accepted
(the target's tokens are there) and the draft's full-vocabulary argmax is often cut away (half the rest is
not), which a head that was not cut, or ids mapped back wrong, would show.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import full_run
import pytest
import torch
from safetensors.torch import save_file
from test_spec_decode_distribution import SAMPLES, chi_square_p, first_three
from test_spec_decode_exactness import GREEDY, K, assert_same, random_prompts, run
from test_spec_draft_model import NOISE, with_draft

from pagedllm import LLM, SamplingParams
from pagedllm.testing.draft_checkpoint import noisy_draft
from pagedllm.worker.draft_proposer import (DRAFT_VOCAB_FILE, DRAFT_VOCAB_TENSOR, DraftProposer, DraftRequest,
                                            Proposal, load_draft_vocab)

FULL = full_run.full()


def subset_draft(model_dir: Path, out: Path, keep: set[int], noise: float = NOISE) -> tuple[Path, torch.Tensor]:
    """A noisy draft of ``model_dir`` whose vocabulary is ``keep`` plus every other remaining id."""
    vocab_size = LLM(model=str(model_dir), dtype="float32").engine.model.vocab_size
    rest = [token for token in range(vocab_size) if token not in keep]
    ids = torch.tensor(sorted(keep | set(rest[::2])), dtype=torch.int64)
    noisy_draft(model_dir, out, noise)
    save_file({DRAFT_VOCAB_TENSOR: ids}, out / DRAFT_VOCAB_FILE)
    return out, ids


def recording(llm: LLM) -> list[Proposal]:
    """Every proposal the engine's draft makes from now on."""
    proposer = llm.engine.speculative.draft if llm.engine.speculative is not None else None
    assert isinstance(proposer, DraftProposer)
    seen: list[Proposal] = []
    propose = proposer.propose

    def wrapped(requests: Sequence[DraftRequest]) -> list[Proposal]:
        proposals = propose(requests)
        seen.extend(proposals)
        return proposals

    proposer.propose = wrapped  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3"] if FULL else ["llama"])
def test_greedy_with_a_cut_vocabulary_equals_without_and_drafts_only_its_tokens(
        arch: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = random_prompts(seed=21)[:4]
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    emitted = {token for samples in want for sample in samples for token in sample.token_ids}
    draft, ids = subset_draft(model_dir, tmp_path / "draft", emitted)
    llm = with_draft(model_dir, draft)
    head = llm.engine.speculative.draft.runner.model.lm_head  # type: ignore[union-attr]
    assert head is not None and head.out_features == len(ids)
    proposals = recording(llm)
    assert_same(run(llm, prompts, GREEDY), want)
    drafted = {token for proposal in proposals for token in proposal.token_ids}
    assert drafted and drafted <= set(ids.tolist())
    counts = llm.engine.stats().spec_decode
    assert counts is not None and 0 < counts.num_accepted_tokens < counts.num_draft_tokens


def test_the_cut_head_scores_exactly_the_full_heads_columns(tiny_model_dir: Callable[[str], Path],
                                                           tmp_path: Path) -> None:
    """The cut draft's logits are the uncut draft's at the kept ids (same weights, same input, both float32)."""
    model_dir = tiny_model_dir("llama")
    draft, ids = subset_draft(model_dir, tmp_path / "draft", set(range(0, 200, 3)))
    cut = with_draft(model_dir, draft, draft_dtype="float32")
    hidden = torch.randn(3, cut.engine.model.hidden_size, generator=torch.Generator().manual_seed(0))
    cut_model = cut.engine.speculative.draft.runner.model  # type: ignore[union-attr]
    uncut = LLM(model=str(draft), dtype="float32").engine.model
    torch.testing.assert_close(cut_model.compute_logits(hidden), uncut.compute_logits(hidden)[:, ids])


def test_sampled_drafts_from_a_cut_vocabulary_carry_q_zero_outside_it(tiny_model_dir: Callable[[str], Path],
                                                                      tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(seed=22)[:2]
    want = run(LLM(model=str(model_dir), dtype="float32"), prompts, GREEDY)
    emitted = {token for samples in want for sample in samples for token in sample.token_ids}
    draft, ids = subset_draft(model_dir, tmp_path / "draft", emitted)
    llm = with_draft(model_dir, draft)
    proposals = recording(llm)
    run(llm, prompts, SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True))
    outside = torch.ones(llm.engine.model.vocab_size, dtype=torch.bool)
    outside[ids] = False
    rows = [proposal for proposal in proposals if proposal.token_ids]
    assert rows
    for proposal in rows:
        assert proposal.probs is not None and proposal.probs.shape == (len(proposal.token_ids), len(outside))
        assert not proposal.probs[:, outside].any()
        torch.testing.assert_close(proposal.probs.sum(dim=-1), torch.ones(len(proposal.token_ids)))
        assert all(float(proposal.probs[row, token]) > 0 for row, token in enumerate(proposal.token_ids))
    counts = llm.engine.stats().spec_decode
    assert counts is not None and 0 < counts.num_accepted_tokens < counts.num_draft_tokens


@pytest.mark.full
def test_first_three_tokens_follow_the_target_distribution_with_a_cut_vocabulary(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """As test_spec_draft_model's distribution test, with half the vocabulary cut from the draft: the target's
    tokens outside it can only come from the residual max(p - q, 0), which must make up for them exactly."""
    model_dir = tiny_model_dir("llama")
    plain = LLM(model=str(model_dir), dtype="float32", max_num_seqs=256)
    want = first_three(plain, range(SAMPLES))
    common = {token for sample in want for token in sample}
    # Half of the tokens the target samples here stay out of the draft's reach.
    draft, _ = subset_draft(model_dir, tmp_path / "draft", set(sorted(common)[::2]), noise=0.02)
    llm = with_draft(model_dir, draft, 0.3, max_num_seqs=256)
    got = first_three(llm, range(SAMPLES, 2 * SAMPLES))
    counts = llm.engine.stats().spec_decode
    assert counts is not None and counts.num_drafts > SAMPLES and 100 < counts.num_accepted_tokens_per_pos[0]
    for name, pick in (("joint", lambda t: t), ("t1", lambda t: t[0]), ("t2", lambda t: t[1]), ("t3", lambda t: t[2])):
        p = chi_square_p([pick(t) for t in got], [pick(t) for t in want])
        assert p > 1e-3, f"{name}: the speculative samples differ from the target's (chi-square p={p:.2e})"


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / DRAFT_VOCAB_FILE)
    return path


@pytest.mark.parametrize(("tensors", "message"), [
    ({DRAFT_VOCAB_TENSOR: torch.tensor([1, 2, 100])}, "holds token id 100, outside the target's vocabulary of 100"),
    ({DRAFT_VOCAB_TENSOR: torch.tensor([-1, 2])}, "holds token id -1"),
    ({DRAFT_VOCAB_TENSOR: torch.tensor([3, 5, 3])}, "lists a token id more than once"),
    ({DRAFT_VOCAB_TENSOR: torch.tensor([1.0, 2.0])}, "must be a non-empty 1-D integer tensor, got torch.float32"),
    ({DRAFT_VOCAB_TENSOR: torch.tensor([[1, 2]])}, "of shape (1, 2)"),
    ({DRAFT_VOCAB_TENSOR: torch.tensor([], dtype=torch.int64)}, "must be a non-empty"),
    ({"d2t": torch.tensor([1, 2])}, "holds tensors ['d2t']: expected exactly ['draft_to_target']"),
])
def test_a_bad_draft_vocabulary_is_refused_naming_the_file(tmp_path: Path, tensors: dict[str, torch.Tensor],
                                                          message: str) -> None:
    folder = write(tmp_path / "draft", tensors)
    with pytest.raises(ValueError, match="draft vocabulary") as error:
        load_draft_vocab(folder, 100)
    assert str(folder / DRAFT_VOCAB_FILE) in str(error.value) and message in str(error.value)


def test_an_unreadable_draft_vocabulary_fails_the_engine_load(tiny_model_dir: Callable[[str], Path],
                                                              tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    draft = noisy_draft(model_dir, tmp_path / "draft", NOISE)
    (draft / DRAFT_VOCAB_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        with_draft(model_dir, draft)


def test_without_the_file_the_draft_scores_the_whole_vocabulary(tmp_path: Path) -> None:
    assert load_draft_vocab(tmp_path, 100) is None


def test_int32_ids_load_as_int64_in_their_order(tmp_path: Path) -> None:
    folder = write(tmp_path / "draft", {DRAFT_VOCAB_TENSOR: torch.tensor([7, 3], dtype=torch.int32)})
    ids = load_draft_vocab(folder, 100)
    assert ids is not None and ids.dtype == torch.int64 and ids.tolist() == [7, 3]


def test_the_default_models_draft_ships_a_cut_vocabulary() -> None:
    llm = LLM(dtype="float32", speculative_config={"method": "draft_model", "num_speculative_tokens": K})
    proposer = llm.engine.speculative.draft  # type: ignore[union-attr]
    assert isinstance(proposer, DraftProposer)
    head = proposer.runner.model.lm_head
    assert head is not None and head.out_features < llm.engine.model.vocab_size
