"""The request shapes ``pagedllm bench serving --client vllm`` sends, as ``vllm bench serve`` flags.

* ``random``: vLLM's ``random`` dataset, prompts and outputs uniform in mean x [1 - r, 1 + r].
* ``prefix_repetition``: vLLM's own, ``--num-prefixes`` shared prefixes of ``--prefix-len`` random tokens,
  each followed by a fresh ``--suffix-len``-token suffix; every prompt is one prefix's, in shuffled order.
* ``multi_turn``: chats whose every turn resends the whole conversation so far plus a new user message,
  written here as a ``custom`` dataset (vLLM's client has no multi-turn dataset of its own). Turn k of
  every chat is sent before turn k + 1 of any (``--disable-shuffle``), so a turn's prompt extends one its
  chat sent a wave earlier: the prefix cache holds it unless the server evicted it. The assistant
  replies in the history are fixed text, not what the server answered, as the load is random tokens
  with ``ignore_eos`` anyway.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "prefix_repetition", "multi_turn")
MULTI_TURN_MARKS = 8  # tokens of a turn's "User:" and "Assistant:" marks, at most


@dataclass(frozen=True, slots=True)
class Shape:
    """One dataset's lengths, in tokens (``prefix_len`` is a multi-turn chat's system prompt)."""

    dataset: str
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int
    suffix_len: int
    num_prefixes: int
    turns: int

    def longest_request(self) -> int:
        """The most tokens one request holds: its prompt and its output (a multi-turn chat's templating aside)."""
        if self.dataset == "prefix_repetition":
            return self.prefix_len + self.suffix_len + self.output_len
        if self.dataset == "multi_turn":
            return self.prefix_len + self.turns * (self.suffix_len + self.output_len + MULTI_TURN_MARKS)
        return round((self.input_len + self.output_len) * (1 + self.range_ratio))

    def describe(self) -> str:
        if self.dataset == "prefix_repetition":
            return (f"prefix_repetition: {self.num_prefixes} shared {self.prefix_len}-token prefixes, "
                    f"{self.suffix_len}-token suffixes, {self.output_len} tokens out")
        if self.dataset == "multi_turn":
            return (f"multi_turn: chats of {self.turns} turns, {self.prefix_len}-token system prompt, "
                    f"{self.suffix_len}-token user messages, {self.output_len}-token replies in the history "
                    f"and out")
        def span(mean: int) -> str:
            return f"{round(mean * (1 - self.range_ratio))}-{round(mean * (1 + self.range_ratio))}"

        return f"random prompts {span(self.input_len)} tokens, outputs {span(self.output_len)}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=DATASETS, default="random",
                        help="--client vllm: request shape (pagedllm_bench.serving_datasets)")
    parser.add_argument("--prefix-len", type=int, default=512,
                        help="--client vllm: prefix_repetition's shared prefix, multi_turn's system prompt")
    parser.add_argument("--suffix-len", type=int, default=64,
                        help="--client vllm: prefix_repetition's suffix, multi_turn's user message")
    parser.add_argument("--num-prefixes", type=int, default=4, help="--client vllm: prefix_repetition's prefixes")
    parser.add_argument("--turns", type=int, default=4, help="--client vllm: multi_turn's turns per chat")


def shape_of(args: argparse.Namespace) -> Shape:
    shape = Shape(dataset=args.dataset, input_len=args.input_len, output_len=args.output_len,
                  range_ratio=args.range_ratio, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                  num_prefixes=args.num_prefixes, turns=args.turns)
    for name in ("input_len", "output_len", "prefix_len", "suffix_len", "num_prefixes", "turns"):
        if getattr(shape, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(shape, name)} is invalid: expected at least 1")
    return shape


def client_flags(shape: Shape, num_prompts: int, seed: int, tokenizer_dir: Path, scratch: Path) -> list[str]:
    """The dataset's ``vllm bench serve`` flags for ``num_prompts`` requests (multi_turn writes its file
    into ``scratch``)."""
    if shape.dataset == "random":
        return ["--dataset-name", "random", "--random-input-len", str(shape.input_len),
                "--random-output-len", str(shape.output_len), "--random-range-ratio", str(shape.range_ratio)]
    if shape.dataset == "prefix_repetition":
        if num_prompts % shape.num_prefixes:
            raise ValueError(f"{num_prompts} prompts do not split evenly over --num-prefixes={shape.num_prefixes}")
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(shape.prefix_len),
                "--prefix-repetition-suffix-len", str(shape.suffix_len),
                "--prefix-repetition-num-prefixes", str(shape.num_prefixes),
                "--prefix-repetition-output-len", str(shape.output_len)]
    path = scratch / f"multi-turn-{seed}.jsonl"
    write_multi_turn(path, tokenizer_dir, shape, num_prompts, seed)
    return ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", str(shape.output_len),
            "--skip-chat-template", "--disable-shuffle"]


def multi_turn_prompts(tokenizer_dir: Path, shape: Shape, num_prompts: int, seed: int) -> list[str]:
    """``num_prompts`` prompts of ``num_prompts // turns`` chats, wave by wave: every chat's first turn, then
    every chat's second, ... Turn k + 1 of a chat starts with turn k's prompt."""
    if num_prompts % shape.turns:
        raise ValueError(f"{num_prompts} prompts do not split into chats of --turns={shape.turns}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = random.Random(seed)
    vocabulary = one_token_words(tokenizer)

    def text(tokens: int) -> str:
        # Space-led words of one token each, so a message's tokens do not depend on what precedes it.
        return "".join(" " + rng.choice(vocabulary) for _ in range(tokens))

    chats = [[text(shape.prefix_len)] for _ in range(num_prompts // shape.turns)]
    waves: list[list[str]] = []
    for _ in range(shape.turns):
        wave = []
        for history in chats:
            history.append(f"\nUser: {text(shape.suffix_len)}\nAssistant:")
            wave.append("".join(history))
            history.append(text(shape.output_len))
        waves.append(wave)
    return [prompt for wave in waves for prompt in wave]


def one_token_words(tokenizer: Any) -> list[str]:
    """The ASCII words that ``tokenizer`` encodes, after a space, as one token."""
    words = {tokenizer.decode([token]).strip() for token in range(len(tokenizer))}
    found = sorted(w for w in words if w.isascii() and w.isalpha()
                   and len(tokenizer(" " + w, add_special_tokens=False).input_ids) == 1)
    if len(found) < 16:
        raise ValueError(f"the tokenizer has {len(found)} one-token words; multi_turn needs at least 16")
    return found


def write_multi_turn(path: Path, tokenizer_dir: Path, shape: Shape, num_prompts: int, seed: int) -> None:
    with path.open("w") as sink:
        for prompt in multi_turn_prompts(tokenizer_dir, shape, num_prompts, seed):
            sink.write(json.dumps({"prompt": prompt, "output_tokens": shape.output_len}) + "\n")
