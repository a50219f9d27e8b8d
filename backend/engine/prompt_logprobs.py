"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's log-probability given the
tokens before it, and the top-k alternatives, collected chunk by chunk as the prompt is computed.

vLLM's shape: one entry per prompt token, ``None`` for the first (nothing predicts it), then
``{token_id: logprob}`` holding the prompt's own token and the ``k`` most likely ones. Logprobs
are ``log_softmax`` of the raw float32 logits, as transformers computes them. The position
``p`` of a step's chunk predicts prompt token ``p + 1``; the prompt's last position predicts the
first sampled token, which is not part of them. Such requests bypass the prefix cache
(``KVCacheManager.match_prefix``), so every prompt position passes through a forward; after a
preemption the recomputed positions are not collected twice.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.core.scheduler import SchedulerOutput

PromptLogprobs = list[dict[int, float] | None]


class PromptLogprobsCollector:
    """The prompt logprobs of the requests that asked for them, until each is handed out once."""

    def __init__(self) -> None:
        self._collected: dict[str, PromptLogprobs] = {}
        self._prompts: dict[str, tuple[tuple[int, ...], int]] = {}  # request id -> (prompt ids, k)

    def track(self, request_id: str, prompt_token_ids: tuple[int, ...], k: int) -> None:
        self._collected[request_id] = [None]
        self._prompts[request_id] = (prompt_token_ids, k)

    def wanted(self) -> bool:
        return bool(self._prompts)

    def collect(self, step: SchedulerOutput, hidden: torch.Tensor | None,
                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Read this step's prompt positions of tracked requests from ``hidden`` [num_tokens, hidden_size]
        (the step's flat batch, in scheduled order)."""
        rows: list[int] = []
        targets: list[tuple[str, int]] = []  # (request id, prompt index it predicts)
        offset = 0
        for item in step.scheduled:
            request_id = item.seq.request.request_id
            tracked = self._prompts.get(request_id)
            start = item.seq.num_computed_tokens
            if tracked is not None and item.seq is item.seq.request.sequences[0]:
                prompt, _ = tracked
                have = len(self._collected[request_id])
                for position in range(max(start, have - 1), min(start + item.num_tokens, len(prompt) - 1)):
                    rows.append(offset + position - start)
                    targets.append((request_id, position + 1))
            offset += item.num_tokens
        if not rows:
            return
        if hidden is None:
            raise RuntimeError("prompt logprobs need the step's hidden states, which a replayed graph does not keep")
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)
        widest = max(self._prompts[request_id][1] for request_id, _ in targets)
        top_values, top_ids = logprobs.topk(widest, dim=-1) if widest else (logprobs[:, :0], logprobs[:, :0].long())
        chosen_ids = torch.tensor([self._prompts[r][0][i] for r, i in targets], device=logprobs.device)
        chosen = logprobs.gather(1, chosen_ids[:, None])[:, 0].tolist()
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for row, (request_id, prompt_index) in enumerate(targets):
            prompt, k = self._prompts[request_id]
            entry = dict(zip(top_ids[row][:k], top_values[row][:k]))
            entry[prompt[prompt_index]] = chosen[row]
            self._collected[request_id].append(entry)

    def take(self, request_id: str) -> PromptLogprobs | None:
        """The request's prompt logprobs once every prompt position is in, then never again."""
        collected = self._collected.get(request_id)
        if collected is None or len(collected) < len(self._prompts[request_id][0]):
            return None
        self.discard(request_id)
        return collected

    def discard(self, request_id: str) -> None:
        self._collected.pop(request_id, None)
        self._prompts.pop(request_id, None)
