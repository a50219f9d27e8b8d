"""`pagedllm bench kernels` at its tiny CPU shapes, so the GPU benchmark cannot rot."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pagedllm_bench import kernels as bench


def _args(tmp_path: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--tiny", "--device", "cpu", "--json", str(tmp_path / "kernels.json")])


def test_tiny_run_prints_every_table_and_agrees_with_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench.run(_args(tmp_path))
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    sections = [row["section"] for row in rows]
    tiny = bench.TINY
    assert sections.count("correctness") == len(tiny.correctness)
    assert sections.count("decode") == len(tiny.decode_batches) * len(tiny.decode_contexts)
    assert sections.count("prefill") == len(tiny.prefill_chunks)
    assert all(row["ok"] for row in rows if row["section"] == "correctness")
    assert all(row["triton_ms"] > 0 and row["sdpa_ms"] > 0 for row in rows if row["section"] != "correctness")
    assert "| decode | KV splits | triton ms | triton GB/s |" in printed
    assert "| prefill | triton ms | triton TFLOP/s |" in printed
    assert " NO |" not in printed
    cpu_rows = json.loads((tmp_path / "kernels.json").read_text())["cpu_rows"]
    cpu = bench.cpu_attention.TINY
    assert [row["section"] for row in cpu_rows] == ["cpu layer"] * len(cpu.batches) * len(cpu.contexts) + [
        "cpu step"] * len(cpu.sizes) * len(cpu.batches) * len(cpu.contexts)
    assert all(row["reference_ms"] > 0 and row["production_ms"] > 0 for row in cpu_rows)
    assert "| shape | reference ms | torch path ms | production ms | production speed-up |" in printed
    linears = json.loads((tmp_path / "kernels.json").read_text())["cpu_linears"]
    assert [row["shape"].split(" ")[1] for row in linears] == ["qkv", "gate/up", "down", "lm"]
    assert all(row["mkl_ms"] > 0 and row["onednn_ms"] > 0 and row["packed_ms"] > 0 and row["max_error"] < 1e-5
               for row in linears)
    assert "| shape | F.linear ms | oneDNN packed ms | MKL packed ms | MKL packed vs F.linear |" in printed
    fused = json.loads((tmp_path / "kernels.json").read_text())["cpu_fused"]
    assert [row["shape"].split(",")[0] for row in fused] == [
        "tiny residual add + RMSNorm", "tiny rotary of q and k", "tiny SiLU(gate) x up"]
    assert all(row["torch_ms"] > 0 and row["fused_ms"] > 0 and row["max_error"] < 1e-5 for row in fused)
    assert "| step | torch ms | fused ms | speed-up | max rel. diff |" in printed
    prefill = json.loads((tmp_path / "kernels.json").read_text())["cpu_prefill"]
    if bench.cpu_prefill.load_native_prefill() is not None:
        assert [(row["query_len"], row["context"]) for row in prefill] == [(16, 0), (16, 40)]
        assert all(row["sdpa_ms"] > 0 and row["compiled_ms"] > 0 and row["max_error"] < 1e-5 for row in prefill)
        assert "| heads | query | context | SDPA path ms | compiled ms | compiled speed-up |" in printed


def test_a_wrong_production_cpu_backend_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.attention import backends as attention_backend

    def off_by_a_bit(native: bool = True) -> attention_backend.AttentionBackend:
        backend = attention_backend.torch_backend(native)
        return replace(backend, attend=lambda *args: backend.attend(*args) + 1e-3)

    monkeypatch.setattr(bench.cpu_attention, "torch_backend", off_by_a_bit)
    with pytest.raises(SystemExit, match="production CPU attention disagrees"):
        bench.run(_args(tmp_path))


def test_a_wrong_kernel_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def off_by_a_bit(*args: object, out: torch.Tensor | None = None) -> torch.Tensor:
        from pagedllm.kernels import unified_attention

        return unified_attention(*args, out=out) + 0.1

    monkeypatch.setattr(bench, "_kernel", lambda: off_by_a_bit)
    with pytest.raises(SystemExit, match="disagrees"):
        bench.run(_args(tmp_path))


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H200", 4.8e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
     ("NVIDIA A100-SXM4-80GB", 2.039e12), ("Tesla T4", None)],
)
def test_peak_bandwidth_matches_the_specific_name_first(name: str, peak: float | None) -> None:
    assert bench.peak_bandwidth(name) == peak
