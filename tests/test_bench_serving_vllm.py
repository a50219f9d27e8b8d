"""``pagedllm bench serving --client vllm``: the server it starts and the ratios it reports."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedllm_bench.serving_datasets import Shape, client_flags
from pagedllm_bench.serving_vllm_client import (SERVED_NAME, _row, hit_rate, pagedllm_serve_command,
                                                parse_prefix_cache_counts)
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


def _shape(dataset: str, **lengths: int) -> Shape:
    values = {"input_len": 256, "output_len": 16, "range_ratio": 0.5, "prefix_len": 40, "suffix_len": 8,
              "num_prefixes": 4, "turns": 3, **lengths}
    return Shape(dataset=dataset, **values)


def test_prefix_repetition_flags_name_vllms_own_dataset_and_split_the_prompts_evenly(tmp_path: Path) -> None:
    flags = client_flags(_shape("prefix_repetition", prefix_len=512, suffix_len=64), 96, 0, tmp_path, tmp_path)
    given = dict(zip(flags[::2], flags[1::2]))
    assert given == {"--dataset-name": "prefix_repetition", "--prefix-repetition-prefix-len": "512",
                     "--prefix-repetition-suffix-len": "64", "--prefix-repetition-num-prefixes": "4",
                     "--prefix-repetition-output-len": "16"}
    with pytest.raises(ValueError, match="split evenly"):
        client_flags(_shape("prefix_repetition"), 10, 0, tmp_path, tmp_path)


def test_a_multi_turn_chat_resends_its_earlier_turn_token_for_token(tmp_path: Path,
                                                                     tiny_model_dir: Callable[[str], Path]) -> None:
    """Turn k + 1 of a chat, as the tokenizer encodes it, starts with turn k's tokens (so a prefix cache can hold
    it), and every chat's turn k comes before any chat's turn k + 1 in the file, kept in order."""
    model_dir = tiny_model_dir("llama")
    shape = _shape("multi_turn")
    flags = client_flags(shape, 6, 1, model_dir, tmp_path)
    assert flags[flags.index("--dataset-name") + 1] == "custom" and "--disable-shuffle" in flags
    rows = [json.loads(line) for line in Path(flags[flags.index("--dataset-path") + 1]).read_text().splitlines()]
    assert [row["output_tokens"] for row in rows] == [16] * 6
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(row["prompt"]).input_ids for row in rows]
    for chat in (0, 1):
        first, second, third = ids[chat], ids[chat + 2], ids[chat + 4]
        assert second[: len(first)] == first and third[: len(second)] == second
        assert len(first) < len(second) < len(third) <= shape.longest_request()
    assert ids[0][:8] != ids[1][:8]  # each chat has its own system prompt
    with pytest.raises(ValueError, match="chats of --turns=3"):
        client_flags(shape, 7, 1, model_dir, tmp_path)


def test_hit_rates_come_from_counter_deltas_or_else_the_rate_since_start() -> None:
    vllm_before = parse_prefix_cache_counts('# HELP x\nvllm:prefix_cache_queries_total{engine="0",model_name="llm"} 100.0\n'
                                            'vllm:prefix_cache_hits_total{engine="0",model_name="llm"} 20.0\n')
    vllm_after = parse_prefix_cache_counts('vllm:prefix_cache_queries_total{engine="0",model_name="llm"} 1100.0\n'
                                           'vllm:prefix_cache_hits_total{engine="0",model_name="llm"} 870.0\n'
                                           'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\n')
    assert hit_rate(vllm_before, vllm_after) == 0.85
    ours = parse_prefix_cache_counts('pagedllm:prefix_cache_hit_rate{model="llm",version="1"} 0.81\n')
    assert hit_rate({}, ours) == 0.81
    assert math.isnan(hit_rate({}, {}))
