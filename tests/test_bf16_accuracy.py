"""bfloat16 on the CPU against transformers' own bfloat16 forward of the same checkpoint.

bf16 tokens cannot equal float32's, and sums in another order round differently, so
bf16 is held to agreement instead of identity, with transformers' full-sequence bf16
forward as the judge:

- prefill (teacher-forced over the prompt, through ``prompt_logprobs``, in chunks of
  ``CHUNK`` tokens): pagedllm's top-1 is transformers' top-1 at >= 99% of positions, with
  transformers computing the same chunks through its own KV cache. The chunks matter: a GEMM
  of 64 rows and one of 186 may take different kernels and round differently. On an AMX host
  transformers' own chunked bf16 forward agreed with its full-sequence one at 181 of 186
  positions of the tiny llama, below the bar, while pagedllm agreed with the chunked one at all.
- decode (pagedllm's own greedy tokens, scored by the judge): >= 95%. transformers' own
  bf16 ``generate``, scored the same way, reached 0.68-0.99 on these random tiny models
  (one bf16 rounding flips a near-tie, and a one-row GEMM sums in another order than a
  full-sequence one); pagedllm reached 0.96-0.99. 99% cannot be asked of an incremental
  bf16 decoder here.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import pagedllm
from pagedllm import LLM, SamplingParams

DEFAULT_MODEL = Path(pagedllm.__file__).resolve().parent / "default_model"
PROMPTS = [
    "import os\nimport sys\n\ndef main(argv):\n    for name in argv:\n        print(os.path.join(name))\n" * 3,
    "class Queue:\n    def __init__(self, size):\n        self.items = []\n        self.size = size\n" * 3,
]
GENERATED = 48
CHUNK = 64
MIN_AGREEMENT = 0.99
MIN_DECODE_AGREEMENT = 0.95


@pytest.mark.parametrize("checkpoint", ["default", "llama", "qwen2", "qwen3"])
def test_bf16_top1_agrees_with_transformers_bf16(tiny_model_dir: Callable[[str], Path], checkpoint: str) -> None:
    model_dir = DEFAULT_MODEL if checkpoint == "default" else tiny_model_dir(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    llm = LLM(str(model_dir), dtype="bfloat16", max_num_batched_tokens=CHUNK, num_kv_blocks=64)
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    prefill = decode = positions = 0
    # One prompt at a time, so that its chunks start at multiples of CHUNK, as the judge's do.
    for out in (llm.generate([text], params)[0] for text in PROMPTS):
        prompt, generated = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        judged_prefill = _chunked_top1(model, prompt)
        judged = _top1(model, prompt + generated)
        for position in range(1, len(prompt)):
            entry = out.prompt_logprobs[position]
            prefill += max(entry, key=entry.get) == judged_prefill[position - 1]
        decode += sum(token == judged[len(prompt) - 1 + i] for i, token in enumerate(generated))
        positions += len(prompt) - 1
    assert prefill / positions >= MIN_AGREEMENT, f"prefill: {prefill}/{positions} top-1 agree"
    generated_total = GENERATED * len(PROMPTS)
    assert decode / generated_total >= MIN_DECODE_AGREEMENT, f"decode: {decode}/{generated_total} top-1 agree"


def _chunked_top1(model: torch.nn.Module, ids: list[int]) -> list[int]:
    """The prefill judge: transformers' bf16 argmax over ``ids`` fed in chunks of CHUNK through its KV cache."""
    cache, top1 = DynamicCache(config=model.config), []
    with torch.no_grad():
        for start in range(0, len(ids), CHUNK):
            logits = model(torch.tensor([ids[start:start + CHUNK]]), cache=cache, use_cache=True).logits
            top1 += logits[0].float().argmax(-1).tolist()
    return top1


def _top1(model: torch.nn.Module, ids: list[int]) -> list[int]:
    """The judge: transformers' bf16 argmax after each prefix of ``ids`` (entry p predicts token p + 1)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().argmax(-1).tolist()
