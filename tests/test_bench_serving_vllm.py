"""``pagedllm bench serving --client vllm``: the server it starts and the ratios it reports."""
from __future__ import annotations

from pathlib import Path

from pagedllm_bench.serving_vllm_client import SERVED_NAME, _row, pagedllm_serve_command
from pagedllm.cli import build_parser
from pagedllm.serving.cli import parse_engine_args


def test_the_pagedllm_server_command_is_one_serve_accepts(tmp_path: Path) -> None:
    command, grpc_port = pagedllm_serve_command(tmp_path, 9100, 7, ["max_num_batched_tokens=512"])
    args = build_parser(load_benches=False).parse_args(command[1:])
    assert args.openai_port == 9100 and args.grpc_port == grpc_port and args.served_model_name == SERVED_NAME
    engine = parse_engine_args(args.engine_arg)
    assert engine["seed"] == 7 and engine["dtype"] == "float32" and engine["max_num_batched_tokens"] == 512


def test_rows_take_medians_over_rounds_and_divide_ours_by_theirs() -> None:
    def run(tokens: float, ttft: float) -> dict[str, float]:
        return {"output_throughput": tokens, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": 4.0,
                "p99_tpot_ms": 8.0, "median_itl_ms": 4.0, "p99_itl_ms": 9.0}

    row = _row(16, {"pagedllm": [run(100, 30), run(120, 10), run(110, 20)], "vllm": [run(100, 40), run(100, 40)]})
    assert row["servers"]["pagedllm"]["output_throughput"] == 110
    assert row["ratios"]["output_throughput"] == 1.1
    assert row["ratios"]["median_ttft_ms"] == 0.5
