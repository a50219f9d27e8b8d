"""The real-size benchmark shapes and the roofline bench, without building a real-size checkpoint."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm_bench import roofline, throughput
from pagedllm_bench.models import REAL_SIZES
from pagedllm.testing.tiny_model import ARCHES, _config_kwargs

# Parameters of each body (embedding included), counted from the published configs with a 2,048-row vocabulary.
EXPECTED_PARAMETERS = {"qwen2.5-0.5b": 360, "llama-3.2-1b": 977, "qwen2.5-1.5b": 1314, "qwen3-moe-0.3b": 336}


def _args(module: ModuleType, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name", sorted(REAL_SIZES))
def test_real_sizes_have_the_published_bodies(name: str) -> None:
    real = REAL_SIZES[name]
    config_cls, model_cls = ARCHES[real.arch]
    config = config_cls(**{**_config_kwargs(real.arch, real.shape, real.shape.vocab_size), **real.overrides})
    with torch.device("meta"):
        model = model_cls(config)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(millions - EXPECTED_PARAMETERS[name]) < 2, millions
    if real.arch == "qwen3_moe":
        assert config.mlp_only_layers == [] and config.moe_intermediate_size == 512 and config.num_experts == 16


def test_real_sizes_run_their_own_workloads_in_the_asked_dtype() -> None:
    args = _args(throughput, "--models", "tiny,qwen2.5-0.5b", "--workloads", "long-tail", "--dtype", "bfloat16")
    cases = throughput.plan(args)
    assert [(c.model, c.workload.kind, c.workload.scale) for c in cases] == [
        ("tiny", "long-tail", "full"), ("qwen2.5-0.5b", "uniform-batch", "full"),
        ("qwen2.5-0.5b", "decode-heavy", "full")]
    assert {c.dtype for c in cases} == {"bfloat16"} and cases[1].label == "qwen2.5-0.5b-bfloat16"
    uniform = cases[1].workload
    assert len(uniform.requests) == 16 and {r.max_tokens for r in uniform.requests} == {64}
    assert all(64 <= len(r.prompt_token_ids) <= 256 for r in uniform.requests)
    with pytest.raises(ValueError, match="--models"):
        throughput.plan(_args(throughput, "--models", "qwen2.5-7b"))


def test_roofline_counts_the_weights_a_decode_step_reads(tmp_path: Path) -> None:
    roofline.run(_args(roofline, "--models", "tiny", "--dtypes", "float32,bfloat16", "--batches", "1,2",
                       "--steps", "2", "--prompt-len", "8", "--probe-mib", "8", "--probe-repeats", "2",
                       "--out", str(tmp_path)))
    data = json.loads((tmp_path / "roofline.json").read_text())
    assert set(data["bandwidth_gbs"]) == set(roofline.PROBES) and min(data["bandwidth_gbs"].values()) > 0
    from pagedllm_bench.models import bench_model

    model = AutoModelForCausalLM.from_pretrained(bench_model("tiny"))
    # Untied llama: everything but the input embedding is read once per step.
    body = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    for row in data["rows"]:
        assert row["weight_bytes"] == body * (4 if row["dtype"] == "float32" else 2)
        assert row["step_ms"] > 0 and 0 < row["share"]
    assert [(r["dtype"], r["batch"]) for r in data["rows"]] == [("float32", 1), ("float32", 2), ("bfloat16", 1),
                                                                ("bfloat16", 2)]


def test_moe_steps_read_only_the_experts_they_can_touch() -> None:
    full = roofline.weight_bytes_per_step  # batch 64 touches all 16 experts (1 - (3/4)^64 ~ 1)
    from pagedllm_bench.models import bench_model

    tiny_moe = bench_model("tiny", "qwen3_moe")
    one, many = full(tiny_moe, torch.bfloat16, 1), full(tiny_moe, torch.bfloat16, 64)
    assert one < many
    # top-4 of 16 at one row: a quarter of the expert weights.
    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f"{n}.") * 2
    assert many - one == pytest.approx(0.75 * experts, rel=1e-6)
