"""Seeded benchmark workloads, written to JSON so any engine can replay them.

Three shapes, each at three scales (``full`` is what RESULTS reports,
``quick`` a quarter of it for a fast look, ``tiny`` what the tests run):

* ``long-tail``: prompts of uniform length, output lengths long-tailed
  (``min_out * e^X`` with ``X ~ Exp(1)``, clipped: median about twice the
  minimum, a few percent at the maximum). Static batching pays for the longest
  request of every batch; continuous batching does not.
* ``shared-prefix``: multi-turn chats over a few long system prompts; turn t
  of a conversation repeats its system prompt and every earlier turn, so
  prefix caching can skip most of each prompt.
* ``parallel-sampling``: prompts asking for ``n`` samples each (seeded
  temperature sampling), which share the prompt's KV blocks copy-on-write.
* ``branching-chat``: trees of conversations. Each turn forks into several
  continuations (a user editing, regenerating, exploring); a child's prompt is
  its parent's prompt, the parent's answer (replayed as prompt text) and a new
  user turn. Requests come level by level, so siblings share their parent's
  whole context and a prefix cache skips all of it.
* ``prompt-heavy``: about 3.5 prompt tokens for every output token. Most prompts
  are of mixed length, up to several hundred tokens; the rest sit behind one of a
  few long shared prefixes (a system prompt or a document) plus a question of
  their own. Outputs are long-tailed as in ``long-tail``. Prefill, not decode, is
  most of the work.
* ``decode-heavy``: a chat shape, short prompts and long answers (long-tailed as
  in ``long-tail``, mean about seven times the prompt): the decode step at a
  full batch is most of the work.
* ``mixed-prefix``: the prompt-heavy shape of issue 42, wider than ``prompt-heavy``: prompts
  of 16-500 tokens, a quarter of them behind one of three shared prefixes of 200-400
  tokens each, outputs long-tailed with a mean near 90 and a cap of 400 (at ``full``, 192
  requests).
* ``uniform-batch``: one batch of prompts that arrive together, of uniform
  length, each asking for the same number of tokens (at ``full``, 16 prompts of
  64-256 tokens and 64 out: the shape the real-size comparison of issue 42 used).

Prompts are random token ids in ``[1, vocab_size)``; every request sets
``ignore_eos`` so each engine produces exactly ``max_tokens`` per sample.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("long-tail", "shared-prefix", "parallel-sampling", "branching-chat", "prompt-heavy", "decode-heavy",
         "uniform-batch", "mixed-prefix")
SCALES = ("full", "quick", "tiny")
SAMPLING_TEMPERATURE = 0.8


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    n: int = 1
    temperature: float = 0.0  # 0 is greedy
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str
    scale: str
    seed: int
    vocab_size: int
    requests: tuple[WorkloadRequest, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Tokens every engine must generate: ``max_tokens`` per sample, EOS ignored."""
        return sum(r.max_tokens * r.n for r in self.requests)

    @property
    def max_len(self) -> int:
        """Longest prompt + output of any request: the context an engine must allow."""
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "scale": self.scale,
            "seed": self.seed,
            "vocab_size": self.vocab_size,
            "requests": [
                {"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens, "n": r.n,
                 "temperature": r.temperature, "seed": r.seed}
                for r in self.requests
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        requests = tuple(
            WorkloadRequest(tuple(r["prompt_token_ids"]), r["max_tokens"], r["n"], r["temperature"], r["seed"])
            for r in data["requests"]
        )
        return cls(data["kind"], data["scale"], data["seed"], data["vocab_size"], requests)

    def fingerprint(self) -> str:
        """Short content hash: results from another engine are merged only for the identical workload."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def file_name(self) -> str:
        return f"{self.kind}-{self.scale}.json"

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))
        return path

    @classmethod
    def load(cls, path: Path) -> Workload:
        return cls.from_json(json.loads(Path(path).read_text()))


@dataclass(frozen=True, slots=True)
class _LongTail:
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


@dataclass(frozen=True, slots=True)
class _SharedPrefix:
    num_system_prompts: int
    system_len: int
    num_conversations: int
    turns: int
    user_len: tuple[int, int]
    reply_len: tuple[int, int]  # earlier assistant replies, replayed as prompt text
    output_len: tuple[int, int]


@dataclass(frozen=True, slots=True)
class _ParallelSampling:
    num_prompts: int
    n: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


@dataclass(frozen=True, slots=True)
class _BranchingChat:
    num_trees: int
    system_len: int
    depth: int  # turns from the root to a leaf
    branching: int  # continuations of every turn but the last
    user_len: tuple[int, int]
    reply_len: tuple[int, int]  # a parent's answer, replayed in its children's prompts
    output_len: tuple[int, int]


@dataclass(frozen=True, slots=True)
class _PromptHeavy:
    num_requests: int
    prompt_len: tuple[int, int]  # a prompt of its own
    num_prefixes: int
    prefix_len: int | tuple[int, int]  # one length for all, or each prefix's drawn from the range
    prefixed_share: float  # of requests, behind a shared prefix
    question_len: tuple[int, int]  # what follows a shared prefix
    output_len: tuple[int, int]  # long-tailed between the two


_SHAPES: dict[str, dict[str, Any]] = {
    "full": {
        "long-tail": _LongTail(256, (32, 512), (16, 512)),
        "shared-prefix": _SharedPrefix(4, 384, 32, 4, (16, 64), (16, 64), (16, 128)),
        "parallel-sampling": _ParallelSampling(32, 4, (64, 256), (32, 128)),
        "branching-chat": _BranchingChat(4, 256, 3, 3, (16, 64), (32, 96), (16, 128)),
        "prompt-heavy": _PromptHeavy(128, (32, 448), 3, 320, 0.3, (16, 96), (22, 256)),
        "decode-heavy": _LongTail(32, (32, 160), (96, 384)),
        "uniform-batch": _LongTail(16, (64, 256), (64, 64)),  # long_tail_lengths clips every output to 64
        # Outputs 24 * e^X clipped to 400: mean 24 * (1 + ln(400 / 24)), about 91.
        "mixed-prefix": _PromptHeavy(192, (16, 500), 3, (200, 400), 0.25, (16, 100), (24, 400)),
    },
    "quick": {
        "long-tail": _LongTail(64, (32, 512), (16, 512)),
        "shared-prefix": _SharedPrefix(2, 384, 8, 4, (16, 64), (16, 64), (16, 128)),
        "parallel-sampling": _ParallelSampling(8, 4, (64, 256), (32, 128)),
        "branching-chat": _BranchingChat(2, 256, 3, 2, (16, 64), (32, 96), (16, 128)),
        "prompt-heavy": _PromptHeavy(32, (32, 448), 2, 320, 0.3, (16, 96), (22, 256)),
        "decode-heavy": _LongTail(16, (32, 160), (48, 192)),
        "uniform-batch": _LongTail(8, (64, 256), (32, 32)),
        "mixed-prefix": _PromptHeavy(48, (16, 500), 3, (200, 400), 0.25, (16, 100), (24, 400)),
    },
    "tiny": {
        "long-tail": _LongTail(12, (4, 40), (2, 24)),
        "shared-prefix": _SharedPrefix(2, 24, 3, 2, (2, 8), (2, 8), (2, 8)),
        "parallel-sampling": _ParallelSampling(3, 2, (4, 16), (2, 8)),
        "branching-chat": _BranchingChat(2, 16, 2, 2, (2, 8), (2, 8), (2, 8)),
        "prompt-heavy": _PromptHeavy(8, (8, 40), 1, 32, 0.5, (2, 8), (2, 12)),
        "decode-heavy": _LongTail(4, (4, 16), (6, 24)),
        "uniform-batch": _LongTail(4, (4, 16), (4, 4)),
        "mixed-prefix": _PromptHeavy(8, (4, 40), 2, (16, 32), 0.5, (2, 8), (2, 12)),
    },
}


def make_workload(kind: str, scale: str = "full", seed: int = 0, vocab_size: int = 2048) -> Workload:
    """Build a workload; the same arguments always give the same requests."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid: expected one of {', '.join(KINDS)}")
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is invalid: expected one of {', '.join(SCALES)}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} is invalid: expected >= 2")
    # Each kind draws from its own stream, so adding a kind never changes another's requests.
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    shape = _SHAPES[scale][kind]
    if isinstance(shape, _LongTail):
        requests = _long_tail(rng, shape, vocab_size)
    elif isinstance(shape, _SharedPrefix):
        requests = _shared_prefix(rng, shape, vocab_size)
    elif isinstance(shape, _BranchingChat):
        requests = _branching_chat(rng, shape, vocab_size)
    elif isinstance(shape, _PromptHeavy):
        requests = _prompt_heavy(rng, shape, vocab_size)
    else:
        requests = _parallel_sampling(rng, shape, vocab_size, seed)
    return Workload(kind, scale, seed, vocab_size, tuple(requests))


def long_tail_lengths(rng: np.random.Generator, count: int, low: int, high: int) -> np.ndarray:
    """``low * e^X``, ``X ~ Exp(1)``, clipped to ``high``: mostly short, a few at the maximum."""
    return np.minimum(np.round(low * np.exp(rng.exponential(1.0, count))), high).astype(int)


def _tokens(rng: np.random.Generator, length: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(1, vocab_size, length))


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _long_tail(rng: np.random.Generator, shape: _LongTail, vocab_size: int) -> list[WorkloadRequest]:
    outputs = long_tail_lengths(rng, shape.num_requests, *shape.output_len)
    return [
        WorkloadRequest(_tokens(rng, _uniform(rng, shape.prompt_len), vocab_size), int(out)) for out in outputs
    ]


def _shared_prefix(rng: np.random.Generator, shape: _SharedPrefix, vocab_size: int) -> list[WorkloadRequest]:
    systems = [_tokens(rng, shape.system_len, vocab_size) for _ in range(shape.num_system_prompts)]
    histories = [systems[c % len(systems)] for c in range(shape.num_conversations)]
    requests = []
    # Turn-major order: every conversation's first turn, then every second turn, as chat traffic interleaves.
    for _ in range(shape.turns):
        for c in range(shape.num_conversations):
            histories[c] = histories[c] + _tokens(rng, _uniform(rng, shape.user_len), vocab_size)
            requests.append(WorkloadRequest(histories[c], _uniform(rng, shape.output_len)))
            histories[c] = histories[c] + _tokens(rng, _uniform(rng, shape.reply_len), vocab_size)
    return requests


def _branching_chat(rng: np.random.Generator, shape: _BranchingChat, vocab_size: int) -> list[WorkloadRequest]:
    """Level by level (every tree's roots, then all their children, ...), as a child needs its parent's answer."""
    level = [_tokens(rng, shape.system_len, vocab_size) for _ in range(shape.num_trees)]
    requests = []
    for turn in range(shape.depth):
        prompts = [history + _tokens(rng, _uniform(rng, shape.user_len), vocab_size) for history in level]
        requests += [WorkloadRequest(prompt, _uniform(rng, shape.output_len)) for prompt in prompts]
        if turn + 1 < shape.depth:
            answered = [prompt + _tokens(rng, _uniform(rng, shape.reply_len), vocab_size) for prompt in prompts]
            level = [history for history in answered for _ in range(shape.branching)]
    return requests


def _prompt_heavy(rng: np.random.Generator, shape: _PromptHeavy, vocab_size: int) -> list[WorkloadRequest]:
    """Prefixed and standalone requests interleaved at random, as unrelated traffic arrives."""
    lengths = [shape.prefix_len if isinstance(shape.prefix_len, int) else _uniform(rng, shape.prefix_len)
               for _ in range(shape.num_prefixes)]
    prefixes = [_tokens(rng, length, vocab_size) for length in lengths]
    outputs = long_tail_lengths(rng, shape.num_requests, *shape.output_len)
    requests = []
    for out in outputs:
        if rng.random() < shape.prefixed_share:
            prompt = prefixes[int(rng.integers(len(prefixes)))] + _tokens(rng, _uniform(rng, shape.question_len),
                                                                        vocab_size)
        else:
            prompt = _tokens(rng, _uniform(rng, shape.prompt_len), vocab_size)
        requests.append(WorkloadRequest(prompt, int(out)))
    return requests


def branching_levels(workload: Workload) -> list[Workload]:
    """A branching-chat workload split into its levels (roots, their children, ...): a replay that waits
    for each level before sending the next gives children their parents' answers first."""
    if workload.kind != "branching-chat":
        raise ValueError(f"workload kind={workload.kind!r} is invalid: expected 'branching-chat'")
    shape = _SHAPES[workload.scale]["branching-chat"]
    levels, start = [], 0
    for turn in range(shape.depth):
        size = shape.num_trees * shape.branching**turn
        levels.append(Workload(workload.kind, workload.scale, workload.seed, workload.vocab_size,
                               workload.requests[start : start + size]))
        start += size
    return levels


def _parallel_sampling(
    rng: np.random.Generator, shape: _ParallelSampling, vocab_size: int, seed: int
) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(
            _tokens(rng, _uniform(rng, shape.prompt_len), vocab_size), _uniform(rng, shape.output_len),
            n=shape.n, temperature=SAMPLING_TEMPERATURE, seed=seed * 1000 + i,
        )
        for i in range(shape.num_prompts)
    ]


def main(argv: list[str] | None = None) -> int:
    """Write every workload of one scale as JSON (what scripts/vllm_cpu_bench.sh replays)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--scale", choices=SCALES, default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ", ".join(KINDS))
    parser.add_argument("--out", type=Path, default=Path("docs/results/workloads"))
    args = parser.parse_args(argv)
    for kind in args.kinds.split(","):
        workload = make_workload(kind, args.scale, args.seed, args.vocab_size)
        print(workload.save(args.out / workload.file_name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
