"""pagedllm plan, static side: catalogs, KV block math against hand-computed numbers, errors, the CLI contract."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm.cli import main
from pagedllm.planning import traffic
from pagedllm.planning.feasibility import PlanDoesNotFit, check
from pagedllm.planning.gpu_catalog import CATALOG as GPUS
from pagedllm.planning.kv_math import Deployment, block_size_table, capacity, kv_bytes_per_token, max_model_len_table
from pagedllm.planning.model_catalog import CATALOG, resolve_model
from pagedllm.planning.traffic import LengthDistribution, TimedRequest

CONTRACT_KEYS = {
    "weights_bytes_per_gpu", "kv_bytes_per_token", "num_kv_blocks", "kv_tokens", "max_concurrency",
    "max_model_len_table", "block_size_table", "steps", "predicted_wall_s", "throughput_tok_s", "ttft_p50",
    "ttft_p99", "tpot_p50", "tpot_p99", "preemptions", "kv_peak_usage", "replicas_needed",
}


def test_kv_bytes_per_token_equals_the_hand_computed_figures() -> None:
    # K and V × layers × KV heads × head_dim × 2 bytes (bf16)
    assert kv_bytes_per_token(CATALOG["Llama-3.1-8B"], "bfloat16", 1) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(CATALOG["Qwen2.5-7B"], "bfloat16", 1) == 2 * 28 * 4 * 128 * 2 == 57_344
    # Tensor parallelism splits the KV heads; past their count each GPU keeps one (vLLM replicates them).
    assert kv_bytes_per_token(CATALOG["Llama-3.1-8B"], "bfloat16", 2) == 65_536
    assert kv_bytes_per_token(CATALOG["Llama-3.1-8B"], "bfloat16", 16) == 2 * 32 * 1 * 128 * 2
    assert kv_bytes_per_token(CATALOG["Llama-3.1-8B"], "fp8", 1) == 65_536


def test_catalog_parameter_counts_match_the_published_checkpoints() -> None:
    # The exact counts of the safetensors on the hub: a wrong hyperparameter would move them.
    assert CATALOG["Llama-3.1-8B"].num_params == 8_030_261_248
    assert CATALOG["Qwen2.5-7B"].num_params == 7_615_616_512
    assert CATALOG["Llama-3.2-1B"].num_params == 1_235_814_400


def test_max_concurrency_is_vllms_formula_on_hand_computed_blocks() -> None:
    cap = capacity(Deployment(CATALOG["Llama-3.1-8B"], GPUS["H200"]))
    weights = 8_030_261_248 * 2
    budget = int(143_771 * 2**20 * 0.9) - weights - 2**29  # memory × utilization − weights − runtime reserve
    assert cap.weights_bytes_per_gpu == weights
    assert cap.num_kv_blocks == budget // (131_072 * 16) == 56_782
    assert cap.kv_tokens == 56_782 * 16
    # vLLM: max_concurrency = num_blocks × block_size / max_model_len
    assert cap.max_concurrency == pytest.approx(56_782 * 16 / 131_072)
    # The engine never allocates more than max_num_seqs full-length sequences could use.
    assert cap.engine_kv_blocks == min(56_782, 256 * 131_072 // 16)


def test_max_model_len_table_and_block_waste_by_hand() -> None:
    table = max_model_len_table(kv_tokens=65_536, model_limit=8_192, chosen=3_000)
    assert table == {1024: 64.0, 2048: 32.0, 3000: 65_536 / 3000, 4096: 16.0, 8192: 8.0}
    # prompt 3, output 2: lengths 4 and 5; blocks of 4 hold 4 and 8 slots, 3 of 12 empty
    assert block_size_table([(3, 2)], (4,)) == {4: 25.0}
    assert block_size_table([(3, 2)], (1,)) == {1: 0.0}


def test_impossible_plans_name_the_reason_and_what_would_fit() -> None:
    requests = [TimedRequest(0.0, (1,) * 100, 100)]
    with pytest.raises(PlanDoesNotFit, match="larger than Llama-3.1-8B's limit of 131072") as too_long:
        check(Deployment(CATALOG["Llama-3.1-8B"], GPUS["H200"], max_model_len=200_000), requests)
    assert too_long.value.suggestions == ("--max-model-len 131072 or less",)

    with pytest.raises(PlanDoesNotFit, match="weights need 131.[0-9] GiB per GPU") as too_big:
        check(Deployment(CATALOG["Llama-3.1-70B"], GPUS["L40S"]), requests)
    assert too_big.value.suggestions[0].startswith(
        "--tensor-parallel-size 4 (4 × L40S per replica) with --max-model-len")
    assert too_big.value.suggestions[1] == "--tensor-parallel-size 8 (8 × L40S per replica)"

    with pytest.raises(PlanDoesNotFit, match="one request of max_model_len=131072 tokens needs 16.00 GiB") as no_kv:
        check(Deployment(CATALOG["Llama-3.1-8B"], GPUS["L4"]), requests)
    assert no_kv.value.suggestions[0].startswith("--max-model-len ")
    assert any("--gpu " in s and "H200" in s for s in no_kv.value.suggestions)

    with pytest.raises(PlanDoesNotFit, match="longest request needs 200 tokens"):
        check(Deployment(CATALOG["Llama-3.1-8B"], GPUS["H200"], max_model_len=128), requests)
    with pytest.raises(ValueError, match="Llama-3.1-8B: tensor_parallel_size=3 does not divide the model's 32 attention heads"):
        capacity(Deployment(CATALOG["Llama-3.1-8B"], GPUS["H200"], tensor_parallel_size=3))


def test_models_resolve_from_a_checkpoint_the_hub_cache_or_the_catalog(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    qwen3 = resolve_model(str(tiny_model_dir("qwen3")))
    assert qwen3.model_type == "qwen3" and qwen3.qk_norm
    assert resolve_model("llama-3.1-8b") is CATALOG["Llama-3.1-8B"]
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve_model("meta-llama/Llama-3.1-8B") is CATALOG["Llama-3.1-8B"]  # not cached: the catalog's
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text((tiny_model_dir("llama") / "config.json").read_text())
    cached = resolve_model("acme/tiny")
    assert cached.name == "acme/tiny" and cached.hidden_size == 256
    with pytest.raises(ValueError, match="nor a catalog name: Llama-3.2-1B"):
        resolve_model("acme/unknown")


def test_traffic_distributions_and_files(tmp_path: Path) -> None:
    assert LengthDistribution.parse("64", "--prompt-len") == LengthDistribution("fixed", 64, 64)
    assert LengthDistribution.parse("32-512", "--prompt-len") == LengthDistribution("uniform", 32, 512)
    with pytest.raises(ValueError, match="--output-len='9-3' is invalid"):
        LengthDistribution.parse("9-3", "--output-len")
    fixed = LengthDistribution.parse("8", "x")
    requests = traffic.synthetic(10.0, 5.0, fixed, LengthDistribution.parse("longtail:4-16", "x"), seed=1)
    assert requests == traffic.synthetic(10.0, 5.0, fixed, LengthDistribution.parse("longtail:4-16", "x"), seed=1)
    assert all(len(r.prompt_token_ids) == 8 and 4 <= r.max_tokens <= 16 for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests) and requests[-1].arrival_s < 5


def test_cli_json_has_the_contract_keys_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "plan.png"
    code = main(["plan", "--model", "Qwen2.5-7B", "--gpu", "L40S", "--max-model-len", "8192", "--qps", "4",
                 "--prompt-len", "256", "--output-len", "longtail:16-128", "--duration", "5", "--tpot-p99", "0.05",
                 "--json", "--plot", str(plot), "--plot-replicas", "1,2"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert CONTRACT_KEYS <= data.keys()
    assert data["kv_bytes_per_token"] == 57_344
    assert data["max_concurrency"] == pytest.approx(data["kv_tokens"] / 8192)
    assert data["max_model_len_table"]["8192"] == pytest.approx(data["max_concurrency"])
    assert data["replicas_needed"] >= 1 and data["steps"] > 0 and 0 < data["kv_peak_usage"] <= 1
    assert plot.stat().st_size > 0


def test_cli_says_plainly_when_a_plan_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "Llama-3.1-70B", "--gpu", "A10G", "--qps", "1", "--duration", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not fit: Llama-3.1-70B's weights need 131.4 GiB per GPU" in err
    assert "try:\n  - --tensor-parallel-size 8 (8 × A10G per replica) with --max-model-len" in err
    assert main(["plan", "--model", "Llama-3.1-8B", "--plot", "plan.png"]) == 2
    assert "no traffic to plan for" in capsys.readouterr().err


@pytest.mark.parametrize("model, extra", [
    ("Llama-3.1-8B", []),
    ("Mixtral-8x7B", ["--tensor-parallel-size", "2", "--max-model-len", "16384"]),
])
def test_cli_json_without_traffic_has_the_tables_fields(model: str, extra: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", model, "--gpu", "H200", *extra]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = dict(re.findall(r"^(\S[^\n]*?)  +(\S[^\n]*)$", table, flags=re.MULTILINE))
    assert rows["model"].startswith(f"{data['model']} ({data['num_params'] / 1e9:.2f}B parameters, {data['dtype']}")
    assert rows["hardware"] == f"{data['tensor_parallel_size']} × H200 ({data['gpu_memory_gib']:.1f} GiB)"
    assert rows["weights per GPU"] == f"{data['weights_bytes_per_gpu'] / 2**30:.2f} GiB"
    assert rows["KV bytes per token"] == f"{data['kv_bytes_per_token']:,}"
    assert rows["KV blocks"] == (f"{data['num_kv_blocks']:,} × {data['block_size']} tokens = {data['kv_tokens']:,} "
                                 f"tokens ({data['kv_budget_bytes'] / 2**30:.2f} GiB)")
    assert rows["max concurrency"] == f"{data['max_concurrency']:.2f}× at max_model_len {data['max_model_len']:,}"
    lengths = re.findall(r"^ +([\d,]+) +([\d.]+)×$", table, flags=re.MULTILINE)
    assert {n.replace(",", ""): float(c) for n, c in lengths} == pytest.approx(data["max_model_len_table"], abs=0.006)
    moe = "active parameters" in rows
    assert moe == (model == "Mixtral-8x7B") == ("active_params" in data)
    if moe:
        assert rows["active parameters"].startswith(f"{data['active_params'] / 1e9:.2f}B per token")
        by_seqs = data["weight_bytes_read_per_gpu_by_seqs"]
        read = ", ".join(f"{v / 2**30:.2f} GiB at {b} seqs" for b, v in by_seqs.items())
        assert re.sub(r" \([\d.]+ experts\)", "", rows["active bytes per decode step"]) == read + " per GPU"
    assert not {"steps", "ttft_p99", "replicas_needed"} & data.keys()  # latency and replicas need traffic
