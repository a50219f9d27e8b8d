"""Where ``LLMEngine.step`` spends its time, by part of the step, from a py-spy raw profile.

Record a throughput workload under py-spy (200 Hz, native frames), then classify its samples:

    py-spy record -r 200 --native -f raw -o /tmp/tiny-long-tail.txt -- python -c "
    from pagedllm_bench.engines import run_pagedllm, EngineSettings
    from pagedllm_bench.models import bench_model
    from pagedllm.simulation.workloads import make_workload
    w = make_workload('long-tail', 'full', 0, 2048)
    run_pagedllm(bench_model('tiny'), w, EngineSettings(32, 2048, 16, -(-w.max_len // 16) * 16, 8), 'continuous')"
    python scripts/step_profile_shares.py /tmp/tiny-long-tail.txt

Only samples inside ``LLMEngine.step`` count. A sample belongs to the first part whose frames
it holds, in the order of ``PARTS``: the host path is everything outside the runner's forward,
plus the input batch's prepare.
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable

Frames = list[str]


def _calls(frames: Frames, function: str, file: str) -> bool:
    # py-spy names a frame "Class.function (path/file.py:line)"
    return any(frame.split(" (")[0].split(".")[-1] == function and file in frame for frame in frames)


def _in(frames: Frames, *files: str) -> bool:
    return any(file in frame for frame in frames for file in files)


PARTS: tuple[tuple[str, Callable[[Frames], bool]], ...] = (
    ("host path (prepare, schedule, sampling, update, outputs)",
     lambda f: not _calls(f, "execute", "model_runner.py") or _in(f, "input_batch.py")),
    ("linears (MKL packed, LM head)", lambda f: _in(f, "cpu_linear.py") or _calls(f, "compute_logits", "llama.py")),
    ("K/V write", lambda f: any("write_kv" in frame for frame in f)),
    ("decode attention (compiled routine)", lambda f: _in(f, "native_decode.py")),
    ("prefill attention (SDPA + gather, plan)",
     lambda f: _in(f, "cpu_attention.py", "cpu_attention_plan.py", "attention_backend.py")),
    ("fused elementwise steps", lambda f: _in(f, "cpu_fused_ops.py")),
    ("Python around the forward (module calls, views, rotary table, embedding)", lambda f: True),
)


def shares(path: str) -> dict[str, float]:
    counts: Counter[str] = Counter()
    with open(path) as profile:
        for line in profile:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not _calls(frames, "step", "llm_engine.py"):
                continue
            part = next(name for name, holds in PARTS if holds(frames))
            counts[part] += int(count)
    total = sum(counts.values())
    if total == 0:
        raise SystemExit(f"{path}: no samples inside LLMEngine.step")
    return {name: counts[name] / total for name, _ in PARTS}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    tables = {path: shares(path) for path in sys.argv[1:]}
    print("| share of the step | " + " | ".join(tables) + " |")
    print("|---" * (len(tables) + 1) + "|")
    for name, _ in PARTS:
        print(f"| {name} | " + " | ".join(f"{100 * table[name]:.0f}%" for table in tables.values()) + " |")


if __name__ == "__main__":
    main()
