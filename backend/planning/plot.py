"""``pagedllm plan --plot FILE.png``: KV usage over time, TTFT/TPOT CDFs, throughput against replicas."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedllm.planning.plan import Plan


def save_plot(plan: Plan, path: Path) -> Path:
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("--plot needs matplotlib, which pagedllm's runtime does not install: "
                         "pip install 'pagedllm[bench]'") from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (usage, cdf, scaling) = plt.subplots(1, 3, figsize=(15.0, 4.2))
    try:
        run = plan.replay
        if run.kv_usage:
            times, shares = zip(*run.kv_usage)
            usage.plot(times, [100 * s for s in shares], lw=1)
        usage.set(xlabel="predicted time (s)", ylabel="KV blocks referenced (%)", ylim=(0, 105),
                  title=f"KV usage, one replica ({plan.capacity.engine_kv_blocks:,} blocks)")

        for label, values in (("TTFT", run.ttft_s), ("TPOT", run.tpot_s)):
            if values:
                xs = np.sort(np.asarray(values))
                cdf.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
        slos = (("TTFT p99 SLO", plan.slo.ttft_p99_s, "C0"), ("TPOT p99 SLO", plan.slo.tpot_p99_s, "C1"))
        for label, slo, color in slos:
            if slo is not None:
                cdf.axvline(slo, ls="--", lw=1, color=color, label=label)
        cdf.set(xscale="log", xlabel="seconds", ylabel="share of requests", title="Latency CDFs, one replica")
        cdf.legend(fontsize=8)

        counts = list(plan.by_replicas)
        scaling.plot(counts, [plan.by_replicas[c].throughput_tok_s for c in counts], marker="o")
        if plan.replicas_needed is not None:
            scaling.axvline(plan.replicas_needed, ls="--", lw=1, color="grey", label="replicas needed")
            scaling.legend(fontsize=8)
        scaling.set(xlabel="replicas (round-robin)", ylabel="output tokens/s", title="Throughput vs replicas")
        figure.suptitle(f"{plan.deployment.model.name} on {plan.deployment.tensor_parallel_size} × "
                        f"{plan.deployment.gpu.name}: {plan.step_model.source}", fontsize=9)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)
    return path
