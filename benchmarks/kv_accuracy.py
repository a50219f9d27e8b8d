"""KV cache accuracy: an 8-bit KV cache against the full-precision one, teacher-forced and free-running.

For each model, the full-precision engine (``kv_cache_dtype=auto``, float32) first
continues every prompt greedily; prompt + continuation is the reference text. Each
cache then reads the whole reference text as one prompt with ``prompt_logprobs`` (so
every position sees the same, full-precision context; chunked prefill makes later chunks
read the quantized K/V of earlier ones) and we compare, at the continuation's positions,
the next-token distributions with the full-precision engine's:

* **teacher-forced top-1 agreement**: the most likely next token is the same;
* **KL divergence** KL(full || quantized) over the whole vocabulary, mean and max;
* beside them, **free-running** greedy agreement position by position and the mean
  position of the first divergence (one flipped token changes everything after it).

Models: the embedded default model (trained; held-out stdlib modules as prompts) and a
tiny random-weight checkpoint with long contexts (1,000+ tokens). The random model's
near-flat distributions flip on any perturbation: it shows the mechanics, not the accuracy.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm_bench import report
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.engine.prompt_logprobs import PromptLogprobsCollector

HELD_OUT = ("json", "csv", "textwrap", "fractions", "heapq", "shlex", "queue", "graphlib")
ROWS = (("fp8_e4m3", False), ("fp8_e4m3", True), ("fp8_e5m2", False))


class FullDistributions(PromptLogprobsCollector):
    """The engine's prompt-logprobs collector, also keeping each prompt position's whole log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[torch.Tensor]] = {}

    def collect(self, step: SchedulerOutput, hidden: torch.Tensor | None,
                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        captured: list[torch.Tensor] = []

        def recording(states: torch.Tensor) -> torch.Tensor:
            logits = compute_logits(states)
            captured.append(torch.log_softmax(logits.float(), dim=-1))
            return logits

        before = {rid: len(entries) for rid, entries in self._collected.items()}
        super().collect(step, hidden, recording)
        if not captured:
            return
        start = 0
        for item in step.scheduled:  # the collector fills requests in scheduled order
            request_id = item.seq.request.request_id
            gained = len(self._collected.get(request_id, ())) - before.get(request_id, 0)
            if gained > 0:
                self.rows.setdefault(request_id, []).append(captured[0][start : start + gained])
                start += gained


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    model: str | None  # None: the embedded default model
    prompts: list[list[int]]
    new_tokens: int
    max_num_batched_tokens: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256, help="continuation length on the embedded model")
    parser.add_argument("--long-context", type=int, default=1024, help="tokens of the random model's contexts")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens, 256-token contexts (a smoke run)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    info = report.machine()
    print(report.header("pagedllm bench kv-accuracy", info))
    num_prompts = 2 if args.quick else args.prompts
    new_tokens = 32 if args.quick else args.new_tokens
    long_context = 256 if args.quick else args.long_context
    results = []
    for case in (_default_model_case(num_prompts, new_tokens), _random_model_case(num_prompts, long_context)):
        results.extend(measure(case))
    print(report.markdown_table(
        ("model", "kv_cache_dtype", "scales", "contexts", "teacher-forced top-1", "mean KL", "max KL",
         "free-running agreement", "mean first divergence"),
        [[r["model"], r["kv_cache_dtype"], r["scales"], r["contexts"], f"{100 * r['top1']:.2f}%",
          f"{r['mean_kl']:.2e}", f"{r['max_kl']:.2e}", f"{100 * r['free_running']:.1f}%",
          f"{r['first_divergence']:.1f}"] for r in results]))
    report.write_json(args.out / "kv_accuracy.json", {"machine": info, "rows": results})
    print(f"\nwrote {args.out / 'kv_accuracy.json'}")


def measure(case: Case) -> list[dict[str, Any]]:
    """One row per 8-bit cache: teacher-forced and free-running figures against the full-precision cache."""
    from pagedllm import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=case.new_tokens, temperature=0.0, ignore_eos=True)
    common = dict(dtype="float32", max_num_batched_tokens=case.max_num_batched_tokens, num_kv_blocks=1024,
                  attention_backend="torch")
    reference = LLM(case.model, **common)
    continued = [list(out.outputs[0].token_ids) for out in
                 reference.generate([{"prompt_token_ids": p} for p in case.prompts], greedy, use_tqdm=False)]
    texts = [prompt + tokens for prompt, tokens in zip(case.prompts, continued)]
    full = _distributions(reference, texts)
    reference.close()
    rows = []
    for kv_dtype, calculated in ROWS:
        llm = LLM(case.model, kv_cache_dtype=kv_dtype, calculate_kv_scales=calculated, **common)
        quantized = _distributions(llm, texts)
        free = [list(out.outputs[0].token_ids) for out in
                llm.generate([{"prompt_token_ids": p} for p in case.prompts], greedy, use_tqdm=False)]
        llm.close()
        top1, kls = [], []
        for prompt, p, q in zip(case.prompts, full, quantized):
            tail = slice(len(prompt) - 1, None)  # the positions that predict the continuation
            top1.append((p[tail].argmax(-1) == q[tail].argmax(-1)).float())
            kls.append((p[tail].exp() * (p[tail] - q[tail])).sum(-1))
        agree = [sum(a == b for a, b in zip(x, y)) / len(x) for x, y in zip(continued, free)]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(continued, free)]
        kl = torch.cat(kls)
        rows.append({
            "model": case.name, "kv_cache_dtype": kv_dtype, "scales": "first prefill" if calculated else "1.0",
            "contexts": f"{len(case.prompts)} x {min(map(len, texts))}-{max(map(len, texts))} tokens",
            "top1": float(torch.cat(top1).mean()), "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "free_running": sum(agree) / len(agree), "first_divergence": sum(first) / len(first),
        })
    return rows


def _distributions(llm: Any, texts: list[list[int]]) -> list[torch.Tensor]:
    """Each text's next-token log-distributions at every position but the last, [len - 1, vocab]."""
    from pagedllm import SamplingParams

    collector = FullDistributions()
    llm.engine.prompt_logprobs = collector
    outputs = llm.generate([{"prompt_token_ids": t} for t in texts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)
    return [torch.cat(collector.rows[out.request_id]) for out in outputs]


def _default_model_case(num_prompts: int, new_tokens: int) -> Case:
    from pagedllm.core.model_source import DEFAULT_MODEL_DIR
    from pagedllm.testing.tokenizer_training import python_stdlib_texts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    limit = 512 - new_tokens  # the model's context
    texts = [text for text in python_stdlib_texts(include=HELD_OUT) if len(text) > 4000][:num_prompts]
    prompts = [tokenizer(text)["input_ids"][: min(200, limit)] for text in texts]
    return Case("default (trained)", None, prompts, new_tokens, max_num_batched_tokens=96)


def _random_model_case(num_prompts: int, context: int) -> Case:
    from pagedllm_bench.models import cache_dir
    from pagedllm.testing.tiny_model import make_tiny_model
    from pagedllm.testing.tokenizer_training import python_stdlib_texts
    from transformers import AutoTokenizer

    target = cache_dir() / f"llama-tiny-context-{2 * context}"
    if not (target / "model.safetensors").is_file():
        make_tiny_model(target, overrides={"max_position_embeddings": 2 * context})
    tokenizer = AutoTokenizer.from_pretrained(target)
    new_tokens = 64
    texts = [text for text in python_stdlib_texts(include=HELD_OUT) if len(text) > 8 * context][:num_prompts]
    prompts = [tokenizer(text)["input_ids"][: context - new_tokens] for text in texts]
    return Case("tiny llama (random)", str(target), prompts, new_tokens, max_num_batched_tokens=256)
