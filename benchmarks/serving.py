"""Serving path: a real tritonserver + pagedllm backend under the load client, vs in-process generate.

Starts ``tritonserver`` (the pytriton wheel's) with the pagedllm backend on
free ports, serving the tiny checkpoint with the same engine settings as the
in-process run. For each concurrency, ``client_examples/load_client.py``
keeps that many gRPC streams in flight (closed loop) and reports TTFT and
inter-token latency percentiles and output tokens/s. The in-process row
replays the very same prompts and ``max_tokens`` through ``LLM.generate``
with ``max_num_seqs`` = the concurrency, so "serving / in-process" is what
the Triton path (gRPC, streaming one response per token, the engine thread)
costs at that load. Both sides use the same torch thread count.

When the engine binds CPUs (``--cpu-bind``), the load client runs on the serving
side's CPUs, as a load generator on another host would stay off the engine's: left
free, the kernel moves its threads onto the engine's CPU whenever the serving CPU is
busy. The in-process replay runs unbound, as before.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

from pagedllm_bench import report, serving_vllm_client
from pagedllm_bench.models import bench_model
from pagedllm.platform.cpu_binding import pin_process, split_cpus

MODEL_NAME = "llm"
REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_PBTXT = REPO_ROOT / "model_repository" / MODEL_NAME / "config.pbtxt"
LOAD_CLIENT = REPO_ROOT / "client_examples" / "load_client.py"
OPENAI_LOAD_CLIENT = REPO_ROOT / "client_examples" / "openai_load_client.py"
ROUND_SEED_STRIDE = 100_000  # far from the OpenAI rounds' seed + 1000 k: no round replays another's prompts
THROUGHPUT_TARGET = 0.9  # serving >= 90% of in-process tokens/s at the highest concurrency


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--client", choices=("load", "vllm"), default="load",
                        help="load: our gRPC load client against tritonserver and the in-process engine; vllm: "
                             "`vllm bench serve` against `pagedllm serve --openai-port` and `vllm serve` "
                             "(pagedllm_bench.serving_vllm_client)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated closed-loop client counts (default 1,8,32,64; --client vllm: 1,16)")
    parser.add_argument("--requests-per-client", type=int, default=6, help="requests = max(16, this x concurrency)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="serving / in-process pairs per concurrency, each with its own requests; the ratio is "
                             "over their sums (single rounds moved 77-110%% at concurrency 64 on a noisy host); "
                             "default 4 (--client vllm: 1, each round restarts both servers)")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64, help="mean max_tokens (uniform +-50%%)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--tiny", action="store_true", help="concurrency 1 and 4, a few short requests (for tests)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-client", type=Path, default=LOAD_CLIENT)
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="serve with the engine core in its own process (engine_process in model.json)")
    parser.add_argument("--cpu-bind", default="auto",
                        help="the engine's cpu_bind: auto, off or a CPU list (pagedllm.platform.cpu_binding)")
    parser.add_argument("--soak", type=int, default=None, metavar="N",
                        help="instead: N requests at concurrency 32, backend stub RSS at the start and the end "
                             "(see pagedllm_bench.serving_soak)")
    parser.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                        help="openai: also drive /v1/chat/completions through the OpenAI front door at each "
                             "concurrency, same server and requests, and compare its throughput with gRPC's")
    parser.add_argument("--openai-rounds", type=int, default=2,
                        help="with --api openai: alternating gRPC/OpenAI load pairs per concurrency")
    serving_vllm_client.add_arguments(parser)


def run(args: argparse.Namespace) -> None:
    from pagedllm.serving.server import TritonServer

    if args.client == "vllm":
        from pagedllm_bench import serving_vllm_client

        args.concurrency = args.concurrency or "1,16"
        args.rounds = args.rounds or 1
        serving_vllm_client.run(args)
        return
    args.concurrency = args.concurrency or "1,8,32,64"
    args.rounds = args.rounds or 4

    if args.openai_rounds < 1 or args.rounds < 1:
        raise SystemExit(f"--rounds and --openai-rounds must be >= 1, got {args.rounds} and {args.openai_rounds}")
    if args.soak is not None:
        from pagedllm_bench.serving_soak import run_soak

        ignored = [flag for flag, value, default in (("--concurrency", args.concurrency, "1,8,32,64"),
                                                      ("--api", args.api, "grpc"), ("--tiny", args.tiny, False))
                   if value != default]
        if ignored:
            raise SystemExit(f"--soak runs its own load (gRPC, concurrency 32); drop {', '.join(ignored)}")

        run_soak(args, load_client_module(args.load_client), write_model_repository, MODEL_NAME)
        return
    report.set_threads(args.threads)
    client = load_client_module(args.load_client)
    levels = [1, 4] if args.tiny else [int(c) for c in args.concurrency.split(",")]
    words, tokens = (8, 8) if args.tiny else (args.prompt_words, args.output_tokens)
    engine_args = {"model": str(bench_model("tiny")), "dtype": "float32", "device": "cpu", "block_size": 16,
                   "max_model_len": args.max_model_len, "max_num_seqs": max(levels), "seed": args.seed,
                   "engine_process": args.engine_process, "cpu_bind": args.cpu_bind}
    info = report.machine()
    print(report.header("pagedllm bench serving", info))
    split = split_cpus(args.cpu_bind, os.sched_getaffinity(0), args.threads) if args.engine_process else None
    client_cpus = split.serving if split is not None and split.serving else None
    placement = (f"engine on CPUs {sorted(split.engine)}, serving side and load client on {sorted(client_cpus)}"
                 if split is not None and client_cpus else "nothing bound")
    print(f"cpu_bind={args.cpu_bind}: {placement}\n")
    rows: list[dict[str, Any]] = []
    scratch = tempfile.TemporaryDirectory(prefix="pagedllm-bench-serving-")
    repository = write_model_repository(Path(scratch.name), engine_args)
    # The backend stub inherits this environment: pin its torch threads like the in-process run's.
    env = {"OMP_NUM_THREADS": str(args.threads)}
    log_tail = ""
    with scratch, TritonServer(repository, env=env, extra_args=["--exit-timeout-secs=20"]) as server, \
            _front_door(args.api, server.grpc_url, Path(engine_args["model"])) as door:
        for level in levels:
            count = 4 * level if args.tiny else max(16, args.requests_per_client * level)
            if not server.running:
                rows.append({"concurrency": level, "requests": count, "failure": "not run: the server had exited"})
                continue
            rows.append(_measure(client, server.grpc_url, engine_args, level, count, words, tokens, args.seed + level,
                                 client_cpus, args.rounds))
            if door is not None and "failure" not in rows[-1]:
                with _running_on(client_cpus):
                    rows[-1].update(_measure_openai(client, server.grpc_url, door.base_url, level, count, words,
                                                    tokens, args.seed + level, args.openai_rounds))
            if "failure" in rows[-1]:
                log_tail = server.log_tail(6000)
    print(f"## tiny model, prompts ~{words} words, max_tokens ~{tokens} (uniform ±50%, ignore_eos), greedy\n")
    print(report.markdown_table(
        ("concurrency", "requests x rounds", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "serving tok/s",
         "in-process tok/s", "serving / in-process", "per round"),
        [_table_row(r) for r in rows]))
    if door is not None:
        _print_openai_table(rows)
    measured = [r for r in rows if "failure" not in r]
    top = rows[-1]
    if "failure" in top:
        print(f"- target: serving >= {100 * THROUGHPUT_TARGET:.0f}% of in-process at concurrency {top['concurrency']}: "
              f"not measured ({top['failure']})")
    else:
        met = top["serving_over_in_process"] >= THROUGHPUT_TARGET
        print(f"- target: serving >= {100 * THROUGHPUT_TARGET:.0f}% of in-process at concurrency "
              f"{top['concurrency']}: {100 * top['serving_over_in_process']:.0f}% ({'met' if met else 'MISSED'})")
    report.write_json(args.out / "serving.json", {"machine": info, "engine_args": engine_args, "rows": rows,
                                                  "server_log_tail": log_tail or None})
    report.save_plot(args.out / "serving.png", lambda ax: _plot(ax, measured))
    print(f"\nwrote {args.out / 'serving.json'} and {args.out / 'serving.png'}")
    openai_failures = [f"concurrency {r['concurrency']}: {r['openai_failure']}" for r in rows if "openai_failure" in r]
    if openai_failures:
        raise RuntimeError("some OpenAI front door runs failed: " + "; ".join(openai_failures))
    if log_tail:
        print(f"server log tail:\n{log_tail}")
        raise RuntimeError("some serving runs failed: " + "; ".join(
            f"concurrency {r['concurrency']}: {r['failure']}" for r in rows if "failure" in r))


def _measure(client: ModuleType, url: str, engine_args: dict[str, Any], level: int, count: int, words: int,
             tokens: int, seed: int, client_cpus: frozenset[int] | None, rounds: int) -> dict[str, Any]:
    """One concurrency level: ``rounds`` pairs of a load client run (on ``client_cpus``) and the in-process
    replay of the same requests. Each round draws its own requests, so no round reuses another's
    prefix-cache blocks on the server; the ratio is over the rounds' sums."""
    loads, offline = [], []
    for round_index in range(rounds):
        round_seed = seed + ROUND_SEED_STRIDE * round_index
        with _running_on(client_cpus):
            load = client.run_load(url, MODEL_NAME, concurrency=level, num_requests=count, prompt_words=words,
                                   prompt_dist="uniform", output_tokens=tokens, output_dist="uniform",
                                   seed=round_seed)
        errors = load.summary()["errors"]
        if errors:
            first = next(r.error for r in load.records if r.error)
            return {"concurrency": level, "requests": count, "errors": errors,
                    "failure": f"{errors} of {count} requests failed: {first}"}
        prompts, max_tokens = same_requests(client, count, words, tokens, round_seed)
        if [r.max_tokens for r in load.records] != max_tokens:
            raise RuntimeError("the in-process replay drew different requests than the load client")
        loads.append(load)
        offline.append(in_process(engine_args, prompts, max_tokens, level, round_seed))
    summary = client.LoadReport(level, tuple(r for load in loads for r in load.records),
                                sum(load.wall_s for load in loads)).summary()
    in_process_tokens_per_s = sum(o["tokens"] for o in offline) / sum(o["seconds"] for o in offline)
    return {**summary, "rounds": rounds, "in_process_s": sum(o["seconds"] for o in offline),
            "in_process_tokens_per_s": in_process_tokens_per_s,
            "serving_over_in_process": summary["output_tokens_per_s"] / in_process_tokens_per_s,
            "round_ratios": [load.summary()["output_tokens_per_s"] / o["tokens_per_s"]
                             for load, o in zip(loads, offline)]}


@contextmanager
def _running_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Every thread of this process on ``cpus`` (``None``: as it is) while the block runs."""
    if cpus is None:
        yield
        return
    before = frozenset(os.sched_getaffinity(0))
    pin_process(cpus)
    try:
        yield
    finally:
        pin_process(before)


def _front_door(api: str, grpc_url: str, model_dir: Path) -> AbstractContextManager[Any]:
    from pagedllm_bench.openai_front_door import OpenAIFrontDoor

    return OpenAIFrontDoor(grpc_url, MODEL_NAME, model_dir) if api == "openai" else nullcontext(None)


def _measure_openai(grpc_client: ModuleType, grpc_url: str, base_url: str, level: int, count: int, words: int,
                    tokens: int, seed: int, rounds: int) -> dict[str, Any]:
    """Both doors under the same load, in alternating order (gRPC first, then OpenAI first, ...) so that
    drift on a shared machine weighs on both alike. Each round draws fresh requests (its own seed), the
    same for both doors; the chat template's leading newline keeps either from reusing the other's
    prefix-cache blocks."""
    chat_client = load_client_module(OPENAI_LOAD_CLIENT, "pagedllm_openai_load_client")
    doors = {"gRPC": (grpc_client, grpc_url), "OpenAI": (chat_client, base_url)}
    reports: dict[str, list[Any]] = {"gRPC": [], "OpenAI": []}
    for round_index in range(rounds):
        order = ("gRPC", "OpenAI") if round_index % 2 == 0 else ("OpenAI", "gRPC")
        for door in order:
            client, url = doors[door]
            reports[door].append(client.run_load(
                url, MODEL_NAME, concurrency=level, num_requests=count, prompt_words=words, prompt_dist="uniform",
                output_tokens=tokens, output_dist="uniform", seed=seed + 1000 * (round_index + 1)))
    summaries = {door: client.LoadReport(level, tuple(r for report in reports[door] for r in report.records),
                                         sum(report.wall_s for report in reports[door])).summary()
                 for door, (client, _) in doors.items()}
    chat, grpc = summaries["OpenAI"], summaries["gRPC"]
    result = {"openai_rounds": rounds, "openai_errors": chat["errors"], "openai_grpc_errors": grpc["errors"],
              "openai_output_tokens_per_s": chat["output_tokens_per_s"], "openai_ttft_s": chat["ttft_s"],
              "openai_grpc_output_tokens_per_s": grpc["output_tokens_per_s"],
              "openai_round_ratios": [a.summary()["output_tokens_per_s"] / b.summary()["output_tokens_per_s"]
                                      for a, b in zip(reports["OpenAI"], reports["gRPC"])]}
    if chat["errors"] or grpc["errors"]:
        return {**result, "openai_failure": f"{chat['errors']} chat and {grpc['errors']} gRPC requests failed"}
    if chat["output_tokens"] != grpc["output_tokens"]:
        return {**result, "openai_failure": f"{chat['output_tokens']} tokens vs gRPC's {grpc['output_tokens']}"}
    return {**result, "openai_over_grpc": chat["output_tokens_per_s"] / grpc["output_tokens_per_s"]}


def _print_openai_table(rows: list[dict[str, Any]]) -> None:
    print("\n## OpenAI front door (/v1/chat/completions, SSE) vs gRPC streams, same server, same requests, "
          "alternating rounds\n")
    print(report.markdown_table(
        ("concurrency", "requests x rounds", "errors", "gRPC tok/s", "OpenAI tok/s", "OpenAI / gRPC",
         "per round", "OpenAI TTFT p50/p90/p99 ms"),
        [[r["concurrency"], f"{r['requests'] // r.get('rounds', 1)} x {r.get('openai_rounds', '–')}",
          r.get("openai_errors", 0) + r.get("openai_grpc_errors", 0), r.get("openai_grpc_output_tokens_per_s", "–"),
          r.get("openai_output_tokens_per_s", "–"),
          f"{100 * r['openai_over_grpc']:.0f}%" if "openai_over_grpc" in r else r.get("openai_failure", "–"),
          " ".join(f"{100 * x:.0f}%" for x in r.get("openai_round_ratios", ())),
          _ms(r["openai_ttft_s"]) if "openai_ttft_s" in r else "–"] for r in rows]))


def _table_row(row: dict[str, Any]) -> list[Any]:
    if "failure" in row:
        return [row["concurrency"], row["requests"], f"FAILED: {row['failure'][:120]}", "–", "–", "–", "–", "–"]
    return [row["concurrency"], f"{row['requests'] // row['rounds']} x {row['rounds']}", _ms(row["ttft_s"]),
            _ms(row["itl_s"]), row["output_tokens_per_s"], row["in_process_tokens_per_s"],
            f"{100 * row['serving_over_in_process']:.0f}%", " ".join(f"{100 * x:.0f}%" for x in row["round_ratios"])]


def load_client_module(path: Path, name: str = "pagedllm_load_client") -> ModuleType:
    """``client_examples/load_client.py`` is a script folder, not a package: load it from its path."""
    if not path.is_file():
        raise ValueError(f"--load-client={path} does not exist (it ships in the repository's client_examples/)")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--load-client={path} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def write_model_repository(folder: Path, engine_args: dict[str, Any]) -> Path:
    version = folder / MODEL_NAME / "1"
    version.mkdir(parents=True, exist_ok=True)
    (folder / MODEL_NAME / "config.pbtxt").write_text(CONFIG_PBTXT.read_text())
    (version / "model.json").write_text(json.dumps(engine_args))
    return folder.resolve()


def same_requests(client: ModuleType, count: int, words: int, tokens: int, seed: int) -> tuple[list[str], list[int]]:
    """The prompts and max_tokens ``run_load`` draws for these arguments (same calls, same order)."""
    rng = random.Random(seed)
    prompt_lengths = client.sample_lengths("uniform", words, count, rng)
    output_lengths = client.sample_lengths("uniform", tokens, count, rng)
    return [client.make_prompt(n, rng) for n in prompt_lengths], output_lengths


def in_process(engine_args: dict[str, Any], prompts: list[str], max_tokens: list[int], concurrency: int,
               seed: int) -> dict[str, float]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**{**engine_args, "max_num_seqs": concurrency})
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, seed=seed + i)
              for i, m in enumerate(max_tokens)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.kv.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    return {"seconds": seconds, "tokens": produced, "tokens_per_s": produced / seconds}


def _ms(stats: dict[str, float | None]) -> str:
    return "/".join("–" if stats[q] is None else f"{1000 * stats[q]:.1f}" for q in ("p50", "p90", "p99"))


def _plot(ax: Any, rows: list[dict[str, Any]]) -> None:
    levels = [r["concurrency"] for r in rows]
    ax.plot(levels, [r["output_tokens_per_s"] for r in rows], marker="o", label="serving (tritonserver, gRPC stream)")
    ax.plot(levels, [r["in_process_tokens_per_s"] for r in rows], marker="s", label="in-process LLM.generate")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Serving vs in-process throughput, tiny model")
    ax.legend()
