"""CUDA graphs on and off: decode throughput of the same engine, side by side (CUDA only).

``pagedllm bench graphs`` builds a random-weight checkpoint with a catalog
model's layer shapes (``--shape``, ``--layers``), then for each decode batch
size runs the same greedy requests through an engine with ``cuda_graphs``
off and one with it on, and prints decode tokens/s, the ratio, whether the two
produced the same tokens, and how long capturing the graphs took. Random
weights make the text meaningless but the arithmetic and the launches real.
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.planning.calibrate import random_checkpoint
from pagedllm.planning.model_catalog import resolve_model


@dataclass(frozen=True, slots=True)
class GraphsRow:
    batch: int
    eager_tokens_per_s: float
    graphs_tokens_per_s: float
    speedup: float
    same_tokens: bool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="Llama-3.2-1B", help="catalog model whose layer shapes to use")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    parser.add_argument("--batches", default="1,8,64,256", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-gb", type=float, default=16.0, help="KV cache per engine")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("pagedllm bench graphs needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    # The random checkpoint is gigabytes: it goes when the benchmark ends.
    with tempfile.TemporaryDirectory(prefix="pagedllm-graphs-") as scratch:
        _compare(args, batches, random_checkpoint(resolve_model(args.shape), Path(scratch) / "model", args.layers))


def _compare(args: argparse.Namespace, batches: list[int], checkpoint: Path) -> None:
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (args.prompt_len,), generator=generator).tolist()}
               for _ in range(max(batches))]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results: dict[bool, dict[int, tuple[float, list[list[int]]]]] = {}
    build_s: dict[bool, float] = {}
    for graphs in (False, True):
        start = time.perf_counter()
        llm = LLM(model=str(checkpoint), dtype="bfloat16", device="cuda", cuda_graphs=graphs,
                  max_num_seqs=max(batches), kv_cache_memory_gb=args.kv_cache_gb, enable_prefix_caching=False)
        build_s[graphs] = time.perf_counter() - start
        # Eager steps compile Triton kernels on each new batch shape; neither side should time that.
        for batch in batches:
            llm.generate(prompts[:batch], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        results[graphs] = {batch: _timed_decode(llm, prompts[:batch], params) for batch in batches}
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    rows = [GraphsRow(batch, results[False][batch][0], results[True][batch][0],
                      results[True][batch][0] / results[False][batch][0],
                      results[False][batch][1] == results[True][batch][1]) for batch in batches]
    print(f"# pagedllm bench graphs: {torch.cuda.get_device_name()}, {args.shape} shapes, "
          f"{args.layers or 'all'} layers, bf16, prompt {args.prompt_len}, output {args.output_len}\n")
    print(f"engine build {build_s[False]:.1f} s eager, {build_s[True]:.1f} s with graph capture\n")
    print("| decode batch | eager tok/s | graphs tok/s | graphs / eager | same greedy tokens |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.batch} | {row.eager_tokens_per_s:.0f} | {row.graphs_tokens_per_s:.0f} | "
              f"{row.speedup:.2f}x | {'yes' if row.same_tokens else 'no'} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"build_s": build_s, "rows": [asdict(row) for row in rows]}, indent=1))


def _timed_decode(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Generated tokens per second of the whole run (its prefill is one or two of its steps), and the tokens."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return generated / elapsed, [list(o.outputs[0].token_ids) for o in outputs]
