"""Quantized checkpoints against transformers loading the same checkpoint: teacher-forced and free-running.

The embedded default model (trained) is quantized here with compressed-tensors in each scheme of
``pagedllm.testing.quantized_checkpoint``. For each, transformers and the engine (float32, both
dequantizing the weights) score the same texts, prompt plus transformers' greedy continuation: top-1
agreement and KL(transformers || engine) over the vocabulary at the continuation's positions, then
free-running greedy agreement. Prints one markdown table.

FP8 schemes get a second row: the engine on its FP8-tensor-core path (``torch._scaled_mm`` with each
Linear's input rounded to FP8, :mod:`pagedllm.layers.fp8_linear`), forced on here because torch's CPU
build runs ``_scaled_mm``: the arithmetic an H200 runs, in this CPU's float32.
Usage: .venv/bin/python scripts/quantized_accuracy.py [--prompts 4] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm_bench.kv_accuracy import HELD_OUT, FullDistributions
from pagedllm.core.model_source import DEFAULT_MODEL_DIR
from pagedllm.layers import fp8_linear
from pagedllm.testing.quantized_checkpoint import SCHEMES, make_quantized_checkpoint
from pagedllm.testing.tokenizer_training import python_stdlib_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    texts = [text for text in python_stdlib_texts(include=HELD_OUT) if len(text) > 4000][: args.prompts]
    prompts = [tokenizer(text)["input_ids"][:200] for text in texts]
    on_tensor_cores = fp8_linear.fp8_tensor_cores
    print("| scheme, engine path | positions | teacher-forced top-1 | mean KL | max KL | free-running agreement |")
    print("|---|---|---|---|---|---|")
    for scheme in SCHEMES:
        model_dir = make_quantized_checkpoint(DEFAULT_MODEL_DIR, Path(tempfile.mkdtemp()) / scheme, scheme)
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        continued, logprobs = [], []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = reference.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                         do_sample=False)
                logprobs.append(torch.log_softmax(reference(out).logits[0, :-1].float(), dim=-1))
            continued.append(out[0].tolist())
        paths = ("dequantized", "_scaled_mm") if scheme.startswith("fp8") else ("dequantized",)
        for path in paths:
            fp8_linear.fp8_tensor_cores = (lambda device: True) if path == "_scaled_mm" else on_tensor_cores
            llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=512, attention_backend="torch")
            fp8_linear.fp8_tensor_cores = on_tensor_cores
            _score(f"{scheme}, {path}", llm, prompts, continued, logprobs, args.new_tokens)
            llm.close()


def _score(name: str, llm: LLM, prompts: list[list[int]], continued: list[list[int]], logprobs: list[torch.Tensor],
           new_tokens: int) -> None:
    """One table row: the engine's distributions over transformers' continuations, and its own greedy text."""
    collector = FullDistributions()
    llm.engine.prompt_logprobs = collector
    scored = llm.generate([{"prompt_token_ids": text} for text in continued],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = [torch.cat(collector.rows[out.request_id]) for out in scored]
    free = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    tail = [slice(len(p) - 1, None) for p in prompts]
    top1 = torch.cat([(p[t].argmax(-1) == q[t].argmax(-1)).float() for p, q, t in zip(logprobs, ours, tail)])
    kl = torch.cat([(p[t].exp() * (p[t] - q[t])).sum(-1) for p, q, t in zip(logprobs, ours, tail)])
    agree = [sum(a == b for a, b in zip(text[len(p):], out.outputs[0].token_ids)) / new_tokens
             for text, p, out in zip(continued, prompts, free)]
    print(f"| {name} | {len(top1)} | {100 * float(top1.mean()):.2f}% | {float(kl.mean()):.1e} | "
          f"{float(kl.max()):.1e} | {100 * sum(agree) / len(agree):.1f}% |", flush=True)


if __name__ == "__main__":
    main()
