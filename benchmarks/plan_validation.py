"""Predicted against measured: ``pagedllm plan``'s wall time beside ``pagedllm bench throughput``'s, side by side.

For each benchmark model, on the workload ``bench throughput`` runs by default
(tiny: long-tail full; small: long-tail quick) with its settings (batch 32,
2048-token steps, blocks of 16, max_model_len the workload's longest request):

1. calibrate the step-time model here (timed engine steps),
2. time the continuous engine on the workload with the benchmark's own runner,
3. calibrate again,

then replay the workload with each calibration. On a shared machine the load
drifts between the three; the two calibrations bracket the timed run, and
their mean is the prediction compared. The same comparison in this process's
CPU time (steps fitted to CPU time, the timed run's CPU time) shows the
model's own error apart from the machine's load. ``python -m pagedllm_bench.plan_validation``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from pagedllm_bench import report
from pagedllm_bench.engines import EngineSettings, run_pagedllm
from pagedllm_bench.models import bench_model
from pagedllm_bench.throughput import VOCAB_SIZE, engine_steps
from pagedllm.simulation.workloads import make_workload
from pagedllm.planning.calibrate import calibrate
from pagedllm.planning.gpu_catalog import this_cpu
from pagedllm.planning.kv_math import Deployment
from pagedllm.planning.model_catalog import resolve_model
from pagedllm.planning.plan import make_plan
from pagedllm.planning.traffic import TimedRequest

SCALES = {"tiny": "full", "small": "quick"}  # what `pagedllm bench throughput` runs by default


def validate(model: str) -> dict[str, Any]:
    workload = make_workload("long-tail", SCALES[model], 0, VOCAB_SIZE)
    max_model_len = -(-workload.max_len // 16) * 16
    settings = EngineSettings(32, 2048, 16, max_model_len, 0)
    model_dir = bench_model(model)
    deployment = Deployment(resolve_model(str(model_dir)), this_cpu(), "float32", "float32",
                            max_model_len=max_model_len, max_num_seqs=settings.max_num_seqs,
                            max_num_batched_tokens=settings.max_num_batched_tokens)
    requests = [TimedRequest(0.0, r.prompt_token_ids, r.max_tokens, r.n) for r in workload.requests]
    before = calibrate(model_dir, dtype="float32")
    cpu_start = time.process_time()
    measured = run_pagedllm(model_dir, workload, settings, "continuous")
    measured_cpu = time.process_time() - cpu_start
    after = calibrate(model_dir, dtype="float32")
    plans = [make_plan(deployment, requests, c.model) for c in (before, after)]
    predicted = statistics.mean(p.replay.predicted_wall_s for p in plans)
    predicted_cpu = statistics.mean(make_plan(deployment, requests, c.cpu_model).replay.predicted_wall_s
                                    for c in (before, after))
    return {
        "model": model, "workload": f"long-tail ({workload.scale})", "requests": len(requests),
        "plan_steps": plans[0].replay.steps,
        "engine_steps": engine_steps(workload, settings, "continuous", measured.extra["num_kv_blocks"]),
        "predicted_before_s": plans[0].replay.predicted_wall_s, "predicted_after_s": plans[1].replay.predicted_wall_s,
        "predicted_s": predicted, "measured_s": measured.seconds, "error": predicted / measured.seconds - 1,
        "predicted_cpu_s": predicted_cpu, "measured_cpu_s": measured_cpu, "cpu_error": predicted_cpu / measured_cpu - 1,
        "calibrations": [before.model.to_json(), after.model.to_json()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("plan-validation.json"))
    args = parser.parse_args(argv)
    report.set_threads(args.threads)
    info = report.machine()
    print(report.header("pagedllm plan: predicted vs measured wall time", info))
    rows = []
    for model in args.models.split(","):
        rows.append(validate(model))
        row = rows[-1]
        print(report.markdown_table(
            ("model", "workload", "plan steps", "engine steps", "predicted s (before / after)", "predicted s (mean)",
             "measured s", "error", "CPU s predicted / measured", "CPU error"),
            [(row["model"], row["workload"], row["plan_steps"], row["engine_steps"],
              f"{row['predicted_before_s']:.1f} / {row['predicted_after_s']:.1f}", row["predicted_s"],
              row["measured_s"], f"{100 * row['error']:+.1f}%",
              f"{row['predicted_cpu_s']:.1f} / {row['measured_cpu_s']:.1f}", f"{100 * row['cpu_error']:+.1f}%")]),
              flush=True)
    report.write_json(args.out, {"machine": info, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
