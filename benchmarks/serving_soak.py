"""``pagedllm bench serving --soak N``: N requests at concurrency 32 through a real server, memory before and after.

The no-leak evidence for long-running servers: the backend stub's resident memory
(and, with ``engine_process``, its engine child's) is read from ``/proc`` after a
warm-up and after every quarter of the N requests. A leak shows as a climb across
the quarters; allocator noise as a plateau. Errors are counted, never hidden.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from pagedllm_bench import report
from pagedllm_bench.models import bench_model
from pagedllm.platform.processes import child_pids

SOAK_CONCURRENCY = 32
WARMUP_REQUESTS = 64


def rss_mib(pid: int) -> float | None:
    """Resident memory of ``pid`` in MiB, None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_soak(args: argparse.Namespace, client: Any, write_model_repository: Any, model_name: str) -> None:
    from pagedllm.serving.server import TritonServer

    if args.soak < SOAK_CONCURRENCY:
        raise ValueError(f"--soak must be >= {SOAK_CONCURRENCY} (one request per client), got {args.soak}")
    report.set_threads(args.threads)
    engine_args = {"model": str(bench_model("tiny")), "dtype": "float32", "device": "cpu", "block_size": 16,
                   "max_model_len": args.max_model_len, "max_num_seqs": SOAK_CONCURRENCY, "seed": args.seed,
                   "engine_process": args.engine_process}
    print(report.header("pagedllm bench serving --soak", report.machine()))
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-soak-") as scratch, \
            TritonServer(write_model_repository(Path(scratch), engine_args),
                         env={"OMP_NUM_THREADS": str(args.threads)}) as server:
        (stub,) = [s.pid for s in server.stubs() if s.model == model_name]

        def load(count: int, seed: int) -> dict[str, Any]:
            return client.run_load(server.grpc_url, model_name, concurrency=SOAK_CONCURRENCY, num_requests=count,
                                   prompt_words=args.prompt_words, prompt_dist="uniform",
                                   output_tokens=args.output_tokens, output_dist="uniform", seed=seed,
                                   progress=False).summary()

        def snapshot(label: str, done: int, errors: int) -> None:
            stub_rss = rss_mib(stub)
            if stub_rss is None:  # a number here would read as "no memory": say what happened instead
                raise RuntimeError(f"the backend stub (pid {stub}) exited during the soak, at {label!r}")
            engine = [rss for pid in child_pids(stub) if (rss := rss_mib(pid)) is not None]
            rows.append([label, done, errors, f"{stub_rss:.0f}", f"{sum(engine):.0f}" if engine else "-"])

        load(WARMUP_REQUESTS, args.seed)
        snapshot("start (after warm-up)", 0, 0)
        done = errors = 0
        quarter = args.soak // 4
        for part in range(4):
            count = quarter if part < 3 else args.soak - 3 * quarter
            summary = load(count, args.seed + 1 + part)
            done += count
            errors += int(summary["errors"])
            snapshot("end" if part == 3 else f"after {done}", done, errors)
    print(f"## {args.soak} requests at concurrency {SOAK_CONCURRENCY}, prompts ~{args.prompt_words} words, "
          f"max_tokens ~{args.output_tokens}\n")
    print(report.markdown_table(("point", "requests done", "errors", "stub RSS MiB", "engine process RSS MiB"), rows))
    start, end = float(rows[0][3]), float(rows[-1][3])
    print(f"\n- stub RSS start -> end: {start:.0f} -> {end:.0f} MiB ({end - start:+.0f} MiB)")
    if errors:
        raise RuntimeError(f"{errors} of {args.soak} soak requests failed")
