"""``pagedllm bench gpu`` on a machine without CUDA: it refuses at once; its arithmetic and drivers are checked here.

The GPU run itself is ``bash scripts/gpu_check.sh gpu`` on a lent device. Here:
the refusal, the roofline's bytes per step for Llama-3.1-8B, the
continuous/static ratio, latency percentiles, the KV-waste replay, and the two
engine drivers run on the tiny CPU model (their timings are not asserted).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm_bench.gpu import REFUSAL
from pagedllm_bench.gpu_measures import (
    RequestTiming,
    decode_bytes_per_step,
    kv_waste,
    replay_at_rate,
    roofline_tokens_per_s,
    speedup,
    summarize_latency,
    timed_decode,
)
from pagedllm.cli import main
from pagedllm.core.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.planning.model_catalog import resolve_model
from pagedllm.planning.step_time import ModelCost
from pagedllm.planning.traffic import TimedRequest
from pagedllm.simulation.workloads import Workload, WorkloadRequest

H200_BYTES_PER_S = 4.8e12


def test_refuses_cleanly_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "gpu", "--json", str(out)])
    assert exit_info.value.code == REFUSAL and "CUDA" in REFUSAL
    assert not out.exists()


def test_roofline_of_llama_8b_decode_steps() -> None:
    """Weights once per step, plus 128 KiB of bf16 K/V per context token (32 layers x 8 KV heads x 128 x K,V)."""
    cost = ModelCost.of(resolve_model("Llama-3.1-8B"), "bfloat16", "bfloat16")
    assert cost.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    assert 15.5e9 < cost.weights_bytes < 16.5e9  # 8.0B parameters in bf16
    assert decode_bytes_per_step(cost, 64, 1000.0) == cost.weights_bytes + 131072 * 64 * 1000
    batch_1 = roofline_tokens_per_s(cost, 1, 512.0, H200_BYTES_PER_S)
    assert batch_1 == pytest.approx(H200_BYTES_PER_S / (cost.weights_bytes + 131072 * 512))
    assert 280 < batch_1 < 300
    # Larger batches share the weights' bytes, so the roofline rises with the batch but saturates on the K/V.
    by_batch = [roofline_tokens_per_s(cost, b, 576.0, H200_BYTES_PER_S) for b in (1, 8, 64, 256)]
    assert by_batch == sorted(by_batch) and by_batch[-1] < H200_BYTES_PER_S / (131072 * 576)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        roofline_tokens_per_s(cost, 1, 512.0, 0.0)


def test_continuous_over_static_ratio() -> None:
    assert speedup(continuous_s=10.0, static_s=230.0) == pytest.approx(23.0)
    assert speedup(continuous_s=4.0, static_s=2.0) == 0.5
    with pytest.raises(ValueError, match="continuous"):
        speedup(continuous_s=0.0, static_s=1.0)


def test_latency_percentiles() -> None:
    timings = [RequestTiming(0.0, 0.5, 2.5, 5), RequestTiming(1.0, 1.1, 1.1, 1), RequestTiming(2.0, 3.0, 4.0, 3)]
    summary = summarize_latency(timings)
    assert summary.requests == 3 and summary.wall_s == 4.0 and summary.output_tokens_per_s == 9 / 4.0
    assert summary.ttft_p50_s == pytest.approx(0.5)  # TTFTs 0.5, 0.1, 1.0
    assert summary.ttft_p99_s == pytest.approx(0.5 + 0.98 * 0.5)
    assert summary.tpot_p50_s == pytest.approx(0.5)  # TPOTs 2.0/4 and 1.0/2; the one-token request has none
    assert summary.tpot_p99_s == pytest.approx(0.5)
    assert summarize_latency([RequestTiming(0.0, 1.0, 1.0, 1)]).tpot_p99_s is None
    with pytest.raises(ValueError, match="timings"):
        summarize_latency([])


def test_kv_waste_is_the_empty_tail_of_each_last_block() -> None:
    """One 20-token prompt in blocks of 16: after its prefill 20 of 32 slots hold tokens, then 21, 22, ..."""
    workload = Workload("long-tail", "tiny", 0, 100, (WorkloadRequest(tuple(range(1, 21)), 5),))
    waste = kv_waste(workload, num_blocks=8, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    assert waste.peak_fraction == pytest.approx(12 / 32)
    assert waste.mean_fraction == pytest.approx((12 + 11 + 10 + 9) / 4 / 32)
    two = Workload("long-tail", "tiny", 0, 100, (WorkloadRequest(tuple(range(1, 17)), 3),
                                                 WorkloadRequest(tuple(range(50, 83)), 3)))
    both = kv_waste(two, num_blocks=16, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    # Step 1 prefills both (16 + 33 tokens: 1 + 3 blocks); step 2's tokens 17 and 34 take the peak of 2 + 3 blocks,
    # whose empty slots are 15 + 14.
    assert both.peak_fraction == pytest.approx(29 / 80)


def test_engine_drivers_on_the_tiny_cpu_model(tiny_model_dir: Callable[[str], Path]) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=64, max_num_seqs=8))
    requests = [TimedRequest(0.0, (5, 6, 7), 4), TimedRequest(0.05, (8, 9, 10, 11), 1), TimedRequest(0.1, (12,), 3)]
    timings = replay_at_rate(engine, requests)
    assert [t.output_tokens for t in timings] == [4, 1, 3]
    for request, timing in zip(requests, timings):
        assert timing.arrival_s == request.arrival_s
        assert request.arrival_s <= timing.first_token_s <= timing.finish_s
    tokens_per_s, context = timed_decode(engine, batch=3, prompt_len=10, output_len=4,
                                         generator=torch.Generator().manual_seed(0))
    assert tokens_per_s > 0 and context == 12.0 and not engine.has_unfinished_requests()
