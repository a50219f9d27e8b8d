"""Incremental detokenization: whole characters only, spacing as decode gives it, stop strings across tokens."""
from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.testing.tokenizer_training import ENDOFTEXT, train_bpe_tokenizer

CORPUS = [
    "héllo wörld 日本語 emoji 🙂",
    "the quick brown fox jumps over the lazy dog",
    "hello world hello there",
    "naïve café über straße",
] * 2
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: decoding drops the space before the first word."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer: PreTrainedTokenizerFast, prompt: Sequence[int], steps: Sequence[Sequence[int]],
           params: SamplingParams | None = None) -> tuple[IncrementalDetokenizer, list[DetokenizerUpdate]]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, params or SamplingParams())
    updates = []
    for step in steps:
        updates.append(detokenizer.update(step))
        if updates[-1].stop_string is not None:
            break
    return detokenizer, updates


def one_per_step(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


def continuation(tokenizer: PreTrainedTokenizerFast, prompt: list[int], output: list[int],
                 skip_special_tokens: bool = True) -> str:
    """What the output adds to the prompt's text when both are decoded together."""
    whole = tokenizer.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    return whole[len(tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)):]


def test_deltas_never_split_a_character_and_concatenate_to_decode(byte_level: PreTrainedTokenizerFast) -> None:
    prompt, output = encode(byte_level, "hello"), encode(byte_level, " héllo wörld 日本語 🙂 naïve")
    assert any(REPLACEMENT in byte_level.decode([t]) for t in output)  # some character spans tokens
    detokenizer, updates = stream(byte_level, prompt, one_per_step(output))
    assert all(REPLACEMENT not in u.text for u in updates)
    emitted = "".join(u.text for u in updates) + detokenizer.flush()
    assert emitted == byte_level.decode(output) == continuation(byte_level, prompt, output)


def test_first_token_keeps_its_leading_space_after_the_prompt(metaspace: PreTrainedTokenizerFast) -> None:
    prompt, output = encode(metaspace, "hello world"), encode(metaspace, "hello there")[:3]
    expected = continuation(metaspace, prompt, output)
    assert expected.startswith(" ") and metaspace.decode(output) != expected  # the prompt matters here
    detokenizer, updates = stream(metaspace, prompt, one_per_step(output))
    assert "".join(u.text for u in updates) + detokenizer.flush() == expected


def test_steps_with_several_or_no_tokens(byte_level: PreTrainedTokenizerFast) -> None:
    prompt, output = encode(byte_level, "the lazy"), encode(byte_level, " dog 日本語 wörld")
    steps = [output[:3], [], output[3:4], output[4:9], output[9:]]
    detokenizer, updates = stream(byte_level, prompt, steps)
    assert all(REPLACEMENT not in u.text for u in updates)
    assert "".join(u.text for u in updates) == continuation(byte_level, prompt, output)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(byte_level: PreTrainedTokenizerFast, skip: bool) -> None:
    eos = byte_level.convert_tokens_to_ids(ENDOFTEXT)
    prompt = [eos] + encode(byte_level, "hello")
    output = encode(byte_level, " world") + [eos] + encode(byte_level, " there")
    detokenizer, updates = stream(byte_level, prompt, one_per_step(output), SamplingParams(skip_special_tokens=skip))
    text = "".join(u.text for u in updates)
    assert text == continuation(byte_level, prompt, output, skip_special_tokens=skip)
    assert (ENDOFTEXT in text) is not skip


def test_prompt_ending_inside_a_character_emits_it_whole(byte_level: PreTrainedTokenizerFast) -> None:
    ids = encode(byte_level, "ab🙂 cd")
    cut = next(k for k in range(1, len(ids)) if byte_level.decode(ids[:k]).endswith(REPLACEMENT))
    detokenizer, updates = stream(byte_level, ids[:cut], one_per_step(ids[cut:]))
    assert [u.text for u in updates if u.text][0] == "🙂"
    assert "".join(u.text for u in updates) + detokenizer.flush() == "🙂 cd"


def test_sample_ending_inside_a_character_flushes_what_decode_gives(byte_level: PreTrainedTokenizerFast) -> None:
    ids = encode(byte_level, " x🙂")
    output = ids[:-1]
    detokenizer, updates = stream(byte_level, encode(byte_level, "hello"), one_per_step(output))
    assert "".join(u.text for u in updates) == " x"
    assert " x" + detokenizer.flush() == byte_level.decode(output)


def test_feed_is_update_of_one_token_for_samples_without_stop_strings(byte_level: PreTrainedTokenizerFast) -> None:
    prompt, output = encode(byte_level, "hello"), encode(byte_level, " héllo wörld 日本語 🙂" * 8)[:-1]
    by_update, updates = stream(byte_level, prompt, one_per_step(output))
    by_feed = IncrementalDetokenizer(byte_level, prompt, SamplingParams())
    assert [by_feed.feed(t) for t in output] == [u.text for u in updates]
    assert by_feed.flush() == by_update.flush() != ""  # the last character is unfinished: flush has it
    with pytest.raises(ValueError, match="feed"):
        by_feed.feed(output[0])
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(byte_level, prompt, SamplingParams(stop=("x",))).feed(output[0])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_truncates(byte_level: PreTrainedTokenizerFast, include: bool) -> None:
    output = encode(byte_level, " the quick brown fox jumps over")
    stop = "own fo"
    assert not any(stop in byte_level.decode([t]) for t in output)  # it spans tokens
    params = SamplingParams(stop=("zzz", stop), include_stop_str_in_output=include)
    detokenizer, updates = stream(byte_level, encode(byte_level, "hello"), one_per_step(output), params)
    expected = " the quick brown fo" if include else " the quick br"
    assert updates[-1].stop_string == stop
    assert "".join(u.text for u in updates) == expected
    assert detokenizer.flush() == ""
    with pytest.raises(ValueError, match="finished"):
        detokenizer.update(output[:1])


def test_partial_stop_string_is_held_back_then_flushed(byte_level: PreTrainedTokenizerFast) -> None:
    output = encode(byte_level, " the quick brown fox")
    detokenizer, updates = stream(byte_level, [], one_per_step(output), SamplingParams(stop=("fox!", "ick!")))
    assert all(u.stop_string is None for u in updates)
    emitted = "".join(u.text for u in updates)
    assert emitted == " the quick brown "  # "fox" could still become "fox!"
    assert emitted + detokenizer.flush() == byte_level.decode(output)


def test_earliest_stop_string_wins_and_min_tokens_defers_matching(byte_level: PreTrainedTokenizerFast) -> None:
    output = encode(byte_level, " the quick brown fox jumps over the lazy dog")
    params = SamplingParams(stop=("lazy", "quick", "brown"))
    detokenizer, updates = stream(byte_level, [], [output], params)
    assert [u.text for u in updates] == [" the "] and detokenizer.flush() == ""
    # Matches that end within the first min_tokens tokens are ignored.
    before_brown = len(encode(byte_level, " the quick brown"))
    deferred = SamplingParams(stop=("quick", "lazy"), min_tokens=before_brown)
    detokenizer, updates = stream(byte_level, [], one_per_step(output), deferred)
    assert "".join(u.text for u in updates) + detokenizer.flush() == " the quick brown fox jumps over the "
    assert updates[-1].stop_string == "lazy"


def test_non_fast_tokenizer_is_rejected() -> None:
    with pytest.raises(ValueError, match="fast"):
        IncrementalDetokenizer(object(), [], SamplingParams())  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(alphabet="ab öé日本🙂\n", min_size=1, max_size=30),
    split=st.integers(min_value=0, max_value=30),
    stop_span=st.tuples(st.integers(0, 30), st.integers(1, 4)),
    chunk=st.integers(min_value=1, max_value=3),
    include=st.booleans(),
)
def test_streaming_matches_decode_and_never_retracts_text(
    byte_level: PreTrainedTokenizerFast, text: str, split: int, stop_span: tuple[int, int], chunk: int,
    include: bool,
) -> None:
    ids = encode(byte_level, text)
    split = min(split, len(ids))
    while split and byte_level.decode(ids[:split]).endswith(REPLACEMENT):
        split -= 1  # a prompt that ends mid-character is covered by its own test
    prompt, output = ids[:split], ids[split:]
    out_text = continuation(byte_level, prompt, output)
    start = min(stop_span[0], max(len(out_text) - 1, 0))
    stop = out_text[start:start + stop_span[1]]
    params = SamplingParams(stop=(stop,) if stop else (), include_stop_str_in_output=include)
    steps = [output[i:i + chunk] for i in range(0, len(output), chunk)]

    detokenizer = IncrementalDetokenizer(byte_level, prompt, params)
    emitted = ""
    for step in steps:
        update = detokenizer.update(step)
        assert REPLACEMENT not in update.text
        emitted += update.text
        if update.stop_string is not None:
            break
    emitted += detokenizer.flush()

    if stop:
        cut = out_text.find(stop)
        expected = out_text[:cut + len(stop)] if include else out_text[:cut]
    else:
        expected = out_text
    # Emitted text is never taken back: every delta is a piece of the final text, in order.
    assert emitted == expected
