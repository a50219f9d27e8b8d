"""``pagedllm bench spec`` runs end to end at a tiny size (no timing is asserted): greedy tokens are checked
equal inside the run, and the copying workload gets its drafts accepted."""
from __future__ import annotations

import json
from pathlib import Path

from pagedllm.cli import build_parser
from pagedllm_bench.spec import batches
from pagedllm.core.model_source import DEFAULT_MODEL_DIR


def test_spec_bench_tiny_run_writes_every_number(tmp_path: Path) -> None:
    args = build_parser(load_benches=True).parse_args(
        ["bench", "spec", "--concurrency", "1,2", "--runs", "1", "--max-tokens", "12", "--prompts", "3",
         "--out", str(tmp_path)])
    args.handler(args)
    written = json.loads((tmp_path / "spec.json").read_text())
    assert (written["dtype"], written["prompts"]) == ("float32", 3)
    rows = written["rows"]
    assert [(row["workload"], row["concurrency"]) for row in rows] == [
        ("copying", 1), ("copying", 2), ("free", 1), ("free", 2)]
    for row in rows:
        assert row["wall_ms_per_token_without"] > 0 and row["wall_ms_per_token_with"] > 0
        assert row["tpot_ms_without"] > 0 and row["tpot_ms_with"] > 0
    assert all(row["tokens_identical"] for row in rows)  # float32: the run itself fails otherwise
    assert rows[0]["drafts"] > 0 and rows[0]["acceptance_length"] > 1
    # A decode step without speculation gives one token, one with it at least one: accepted drafts save steps.
    assert all(row["decode_steps_ratio"] <= 1 for row in rows) and rows[0]["decode_steps_ratio"] < 1


def test_spec_bench_batches_every_prompt_at_each_concurrency() -> None:
    prompts = [[i] for i in range(5)]
    assert batches(prompts, 3, 1) == [[[0]], [[1]], [[2]]]  # one stream: --prompts of them, one at a time
    assert batches(prompts, 3, 2) == [[[0], [1]], [[2]]]
    assert batches(prompts, 3, 4) == [[[0], [1], [2], [3]]]  # more streams than --prompts: one full batch


def test_spec_bench_runs_a_draft_model(tmp_path: Path) -> None:
    # The target as its own draft: every greedy draft is accepted, and at threshold 0 every run is all 3 long.
    args = build_parser(load_benches=True).parse_args(
        ["bench", "spec", "--method", "draft_model", "--draft-model", str(DEFAULT_MODEL_DIR), "--concurrency", "1",
         "--runs", "1", "--max-tokens", "12", "--num-speculative-tokens", "3", "--prompts", "1", "--dtype", "bfloat16",
         "--draft-confidence-threshold", "0", "--out", str(tmp_path)])
    args.handler(args)
    report = json.loads((tmp_path / "spec_draft_model.json").read_text())
    assert (report["config"]["method"], report["dtype"]) == ("draft_model", "bfloat16")
    assert report["config"]["draft_confidence_threshold"] == 0
    assert all(row["drafts"] > 0 and row["acceptance_length"] > 3 for row in report["rows"])
