"""When a sequence ends at the token level: EOS, stop ids, max_tokens, max_model_len.

Stop strings are text, so the engine's output processing finds them; beams use
the same stop ids to finish a hypothesis.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.request import Sample
from pagedllm.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopPolicy:
    """Token-level stops; stop strings are text and are checked by the engine's output processing."""

    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()

    def finish_reason(self, seq: Sample, token_id: int) -> str | None:
        """Why ``seq`` ends now that ``token_id`` was appended to it, if it does."""
        params = seq.request.params
        num_tokens = len(seq.token_ids)  # not the properties: this runs for every sampled token
        num_output_tokens = num_tokens - seq.num_prompt_tokens
        if num_output_tokens >= params.min_tokens and (
            token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos)
        ):
            return "stop"
        if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
            return "length"
        if num_tokens >= self.max_model_len:
            return "length"
        return None

    def stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a beam's hypothesis."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    def max_new_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)
