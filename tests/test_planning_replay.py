"""pagedllm plan, simulated side: the replay takes the real engine's steps, the fit recovers known coefficients."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm.simulation.null_engine import NullEngine
from pagedllm.simulation.workloads import KINDS, make_workload
from pagedllm.core.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.planning.calibrate import Batch, calibrate, random_checkpoint
from pagedllm.planning.gpu_catalog import this_cpu
from pagedllm.planning.kv_math import Deployment, capacity
from pagedllm.planning.model_catalog import ModelSpec, resolve_model
from pagedllm.planning.plan import Slo, make_plan
from pagedllm.planning.replay import EngineLimits, replay, replay_replicas
from pagedllm.planning.step_time import ModelCost, StepShape, StepTimeModel, fit
from pagedllm.planning.traffic import TimedRequest
from pagedllm.core.sampling_params import SamplingParams


@pytest.mark.parametrize("kind", KINDS)
def test_replay_takes_exactly_the_real_engines_steps(kind: str, tiny_model_dir: Callable[[str], Path]) -> None:
    # 24 blocks of 16 for 8 sequences of up to 64 tokens: queueing, chunked prefill and preemption all happen.
    limits = EngineLimits(num_kv_blocks=24, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    workload = make_workload(kind, "tiny")
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir("llama")), dtype="float32", num_kv_blocks=limits.num_kv_blocks,
        block_size=limits.block_size, max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens, max_model_len=128))
    for i, r in enumerate(workload.requests):
        # EOS ignored and a fixed max_tokens, as the benchmark workloads run, so lengths are known up front.
        engine.add_request(str(i), list(r.prompt_token_ids), SamplingParams(
            n=r.n, temperature=r.temperature, seed=r.seed, max_tokens=r.max_tokens, ignore_eos=True))
    real_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        real_steps += 1
    requests = [TimedRequest(0.0, r.prompt_token_ids, r.max_tokens, r.n) for r in workload.requests]
    result = replay(requests, limits, lambda shape: 0.01)
    assert result.steps == real_steps
    assert result.preemptions == engine.stats().num_preemptions
    assert result.kv_peak_usage == engine.stats().peak_blocks_used / limits.num_kv_blocks
    assert result.predicted_wall_s == pytest.approx(0.01 * real_steps)
    assert len(result.ttft_s) == len(requests)


def test_cpu_plan_sizes_the_kv_cache_as_the_engine_does(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir("llama")
    deployment = Deployment(resolve_model(str(model_dir)), this_cpu(), "float32", "float32", max_model_len=512,
                            max_num_seqs=32)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", max_model_len=512,
                                    max_num_seqs=32))
    assert capacity(deployment).engine_kv_blocks == engine.kv.num_blocks


def test_step_shapes_count_tokens_context_and_logits_rows_by_hand() -> None:
    engine = NullEngine(num_blocks=16, block_size=16, max_num_seqs=4, max_num_batched_tokens=16)
    engine.add_request(list(range(1, 25)), SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    shapes = []
    while engine.has_unfinished_requests():
        shapes.append(StepShape.of(engine.step()))
    assert shapes == [
        StepShape(num_seqs=1, num_tokens=16, num_sampled=0, kv_tokens_read=16, attention_pairs=16 * 17 // 2),
        # the prompt's last 8 tokens attend to 17..24 keys; one logits row serves both samples
        StepShape(num_seqs=1, num_tokens=8, num_sampled=1, kv_tokens_read=24, attention_pairs=sum(range(17, 25))),
        StepShape(num_seqs=2, num_tokens=2, num_sampled=2, kv_tokens_read=50, attention_pairs=50),
    ]


def test_fit_recovers_the_coefficients_that_made_the_timings() -> None:
    cost = ModelCost(weights_bytes=10_000_000, kv_bytes_per_token=4096, flops_per_token=20_000_000,
                     flops_per_sampled=1_000_000, flops_per_pair=4096)
    truth = StepTimeModel(2e-3, 5e-5, 1e-10, 2e-11, "truth")
    shapes = [StepShape(b, b, b, b * ctx, b * ctx) for b in (1, 4, 16, 64) for ctx in (32, 512, 2048)]
    shapes += [StepShape(n // 256, n, n // 256, n, n * 128) for n in (256, 1024, 2048)]
    fitted = fit([(s, cost, truth.seconds(cost, s)) for s in shapes], "fit")
    for name in ("overhead_s", "per_seq_s", "s_per_byte", "s_per_flop"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # Both bounds occur: decodes are bound by bytes, prefills by FLOPs.
    assert {cost.bytes(s) * truth.s_per_byte > cost.flops(s) * truth.s_per_flop for s in shapes} == {True, False}
    with pytest.raises(ValueError, match="at least 4 timed steps"):
        fit([(shapes[0], cost, 0.01)], "fit")


def test_calibration_times_the_engine_in_lockstep_with_its_replay(tiny_model_dir: Callable[[str], Path]) -> None:
    batches = (Batch(2, (8, 8), (3, 3)), Batch(4, (16, 16), (2, 2)))
    calibration = calibrate(tiny_model_dir("llama"), dtype="float32", batches=batches, repeats=1)
    # (2 x 8 prompt tokens in one step, then 2 decodes) + (4 x 16 in one step, then 1 decode)
    assert [s.shape.num_tokens for s in calibration.steps] == [16, 2, 2, 64, 4]
    assert all(s.seconds > 0 and calibration.fitted(s) > 0 for s in calibration.steps)
    assert calibration.model.source.startswith("calibrated on cpu")


def test_catalog_models_are_timed_as_random_checkpoints_of_their_shape(tmp_path: Path) -> None:
    spec = ModelSpec("mini", "llama", 64, 4, 4, 2, 32, 128, 50_000, 4096, False)
    model_dir = random_checkpoint(spec, tmp_path / "mini", num_layers=2)
    timed = resolve_model(str(model_dir))
    assert (timed.hidden_size, timed.num_layers, timed.num_kv_heads, timed.head_dim) == (64, 2, 2, 32)
    batches = (Batch(2, (8, 8), (2, 2)), Batch(1, (4, 4), (2, 2)))
    calibration = calibrate(model_dir, dtype="float32", batches=batches, repeats=1)
    assert [s.shape.num_seqs for s in calibration.steps] == [2, 2, 1, 1]


def test_replicas_needed_is_the_smallest_count_meeting_the_slo() -> None:
    model = resolve_model("Llama-3.2-1B")
    deployment = Deployment(model, this_cpu(), "bfloat16", "bfloat16", max_model_len=1024, max_num_seqs=4,
                            kv_cache_memory_gb=1.0)
    requests = [TimedRequest(0.0, (i + 1,) * 200, 50) for i in range(32)]
    step_model = StepTimeModel(0.01, 0.0, 0.0, 0.0, "10 ms per step")
    plan = make_plan(deployment, requests, step_model, Slo(ttft_p99_s=0.5))
    needed = plan.replicas_needed
    assert needed is not None and needed > 1
    assert plan.by_replicas[needed].ttft(99) <= 0.5
    limits = EngineLimits(capacity(deployment).engine_kv_blocks, 16, 4, 2048)
    fewer = replay_replicas(requests, needed - 1, limits, lambda shape: 0.01)
    assert fewer.ttft(99) > 0.5
    unreachable = make_plan(deployment, requests, step_model, Slo(tpot_p99_s=0.001))
    assert unreachable.replicas_needed is None
    assert any("no replica count meets the SLOs" in line for line in unreachable.advice())
