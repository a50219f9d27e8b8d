"""``pagedllm bench structured`` runs end to end at ``--tiny`` (no timing is asserted)."""
from __future__ import annotations

import json
from pathlib import Path

from pagedllm.cli import build_parser


def test_structured_bench_tiny_run_writes_every_number(tmp_path: Path) -> None:
    args = build_parser(load_benches=True).parse_args(["bench", "structured", "--tiny", "--out", str(tmp_path)])
    args.handler(args)
    payload = json.loads((tmp_path / "structured.json").read_text())
    assert [step["rows"] for step in payload["steps"]] == [2, 4]
    for step in payload["steps"]:
        assert step["constrained_ms"] > 0 and step["unconstrained_ms"] > 0 and step["grammar_ms"] > 0
    assert payload["compile_ms"]["count"] >= 50 and payload["compile_ms"]["p99"] >= payload["compile_ms"]["p50"]
