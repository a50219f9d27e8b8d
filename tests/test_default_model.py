"""The embedded default model: small, loadable, actually trained, and served exactly.

The checkpoint is trained by ``scripts/train_default_model.py`` on the Python
standard library with a few whole modules held out (listed in its
``training.json``); these tests read those held-out modules from the running
interpreter, so they measure text the model never saw.
"""
from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers.decoders import DecodeStream
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import pagedllm
from pagedllm.testing.tokenizer_training import python_stdlib_texts, train_bpe_tokenizer

MODEL_DIR = Path(pagedllm.__file__).resolve().parent / "default_model"
MAX_MODEL_BYTES = 20_000_000
EVAL_CHUNKS = 4
PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n\ndef")


@cache
def training_record() -> dict:
    return json.loads((MODEL_DIR / "training.json").read_text())


@cache
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@cache
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@cache
def held_out_texts() -> tuple[str, ...]:
    texts = python_stdlib_texts(include=training_record()["held_out_modules"])
    if not texts:
        pytest.fail("none of the held-out stdlib modules exist in this interpreter")
    return tuple(texts)


def test_checkpoint_is_small_and_half_precision() -> None:
    files = [p for p in MODEL_DIR.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_MODEL_BYTES
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes <= {"BF16", "F16"}


def test_held_out_loss_is_far_below_random_init() -> None:
    seq_len = training_record()["args"]["seq_len"]
    stream = [token for ids in tokenizer()(list(held_out_texts()))["input_ids"] for token in ids]
    if len(stream) < EVAL_CHUNKS * seq_len:
        pytest.fail(f"held-out modules give only {len(stream)} tokens")
    chunks = torch.tensor(stream[: EVAL_CHUNKS * seq_len]).view(EVAL_CHUNKS, seq_len)
    with torch.no_grad():
        loss = model()(input_ids=chunks, labels=chunks).loss.item()
    random_init = math.log(model().config.vocab_size)
    # Trained to roughly a quarter of it; 0.6x leaves room for numeric and stdlib-version drift.
    assert loss < 0.6 * random_init


def test_tokenizer_round_trips_held_out_source() -> None:
    text = held_out_texts()[0]
    ids = tokenizer()(text)["input_ids"]
    assert ids[0] == tokenizer().bos_token_id == model().config.bos_token_id
    assert tokenizer().decode(ids, skip_special_tokens=True) == text
    stream = DecodeStream(skip_special_tokens=True)
    pieces = (stream.step(tokenizer().backend_tokenizer, token) for token in ids)
    assert "".join(piece for piece in pieces if piece is not None) == text


def test_greedy_completions_look_like_python() -> None:
    inputs = tokenizer()("def fibonacci(n):", return_tensors="pt")
    out = model().generate(**inputs, max_new_tokens=32, do_sample=False)
    completion = tokenizer().decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    # A body follows the signature: a newline, then an indented line.
    assert completion.startswith("\n    ")


def test_train_bpe_tokenizer_rejects_a_vocab_without_room_for_bytes() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["x = 1\n"], vocab_size=100)


def test_train_bpe_tokenizer_is_deterministic(tmp_path: Path) -> None:
    texts = list(held_out_texts())
    first = train_bpe_tokenizer(texts, vocab_size=400, out_dir=tmp_path)
    second = train_bpe_tokenizer(texts, vocab_size=400)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(texts[0])["input_ids"] == first(texts[0])["input_ids"]


def test_pagedllm_greedy_tokens_equal_transformers_generate() -> None:
    llm = pagedllm.LLM(model=str(MODEL_DIR), dtype="float32")
    params = pagedllm.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    # ignore_eos on both sides: a fixed length compares more tokens than an early stop would.
    # generate() refills an unset eos from the model's own generation config, so a
    # private copy of the model gets eos removed there.
    reference = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    for prompt in PROMPTS:
        prompt_ids = tokenizer()(prompt)["input_ids"]
        (result,) = llm.generate([prompt], params)
        assert result.prompt_token_ids == prompt_ids
        # An explicit mask: bos is also pad (id 0), and generate() would mask it out
        # as padding once eos no longer equals pad.
        ids = torch.tensor([prompt_ids])
        expected = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )
        assert result.outputs[0].token_ids == expected[0, len(prompt_ids) :].tolist()
