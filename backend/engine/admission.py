"""What a request must satisfy to be admitted, checked once when it arrives and never inside a step.

Anything that could never run is refused here with a ``ValueError`` naming the
field and the limit: a request that waited forever at the head of the queue,
or a token id that only failed inside a step, would hurt every other request.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pagedllm.core.sampling_params import SamplingParams

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    num_blocks: int
    block_size: int

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[int],
                    vocab_size: int) -> tuple[list[int], str | None]:
    """Token ids and text of a prompt given as text or as token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return list(tokenizer.encode(prompt)), prompt
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt_token_ids is empty")
    _check_ids("prompt_token_ids", ids, vocab_size)
    return ids, None


def check_request(prompt_ids: list[int], params: SamplingParams, limits: AdmissionLimits) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if not prompt_ids:
        raise ValueError("prompt is empty after tokenization")
    room = limits.max_model_len - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens but max_model_len is {limits.max_model_len}: "
            "there is no room for a single output token"
        )
    if params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(
            f"max_tokens={params.max_tokens} is too large: the prompt has {len(prompt_ids)} tokens "
            f"and max_model_len is {limits.max_model_len}, so at most {room} can be generated"
        )
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise ValueError(f"logprobs={params.logprobs} is invalid: at most {MAX_LOGPROBS}")
    if params.prompt_logprobs is not None and params.prompt_logprobs > MAX_LOGPROBS:
        raise ValueError(f"prompt_logprobs={params.prompt_logprobs} is invalid: at most {MAX_LOGPROBS}")
    if params.beam_width > limits.max_num_seqs:
        raise ValueError(
            f"beam_width={params.beam_width} is too large: the beams run side by side and max_num_seqs is "
            f"{limits.max_num_seqs}"
        )
    if params.beam_width > limits.max_num_batched_tokens:
        raise ValueError(
            f"beam_width={params.beam_width} is too large: every beam computes a token in the same step and "
            f"max_num_batched_tokens is {limits.max_num_batched_tokens}"
        )
    if params.n > limits.max_num_seqs:
        raise ValueError(
            f"n={params.n} is too large: its samples run side by side and max_num_seqs is {limits.max_num_seqs}"
        )
    _check_ids("stop_token_ids", params.stop_token_ids, limits.vocab_size)
    longest = len(prompt_ids) + (params.max_tokens if params.max_tokens is not None else room)
    # Worst case: the samples (or beams, recomputed after a preemption too) share the prompt's full
    # blocks and each holds the rest on its own.
    shared = len(prompt_ids) // limits.block_size
    fan_out = params.beam_width if params.use_beam_search else params.n
    needed = shared + fan_out * (limits.blocks_needed(longest) - shared)
    if needed > limits.num_blocks:
        field = "beam_width" if params.use_beam_search else "max_tokens" if params.n == 1 else "n"
        raise ValueError(
            f"{field}: request can never fit in the KV cache: {fan_out} sequence(s) of up to {longest} tokens "
            f"need {needed} blocks of {limits.block_size}, the cache has {limits.num_blocks} "
            "(lower max_tokens or n, or raise num_kv_blocks)"
        )


def _check_ids(field: str, ids: Sequence[object], vocab_size: int) -> None:
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field} contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
