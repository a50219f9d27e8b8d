"""Engine snapshots and finished requests -> Triton metric families, through a fake family factory."""
from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from pagedllm.engine.request_timing import RequestTiming, StepTimings
from pagedllm.serving.triton.metrics import (
    E2E_BUCKETS,
    TritonMetrics,
    custom_metrics_enabled,
    gauge_values,
    metric_specs,
    one_two_five_buckets,
)

MAX_MODEL_LEN = 256


@dataclass(frozen=True)
class Stats:
    num_blocks_total: int = 100
    num_blocks_free: int = 100
    peak_blocks_used: int = 0
    num_preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


class FakeMetric:
    def __init__(self, kind: str, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.kind, self.labels, self.buckets = kind, labels, buckets
        self.reading = 0.0
        self.observed: list[float] = []

    def increment(self, value: float) -> None:
        assert self.kind == "counter" and value > 0
        self.reading += value

    def set(self, value: float) -> None:
        assert self.kind == "gauge"
        self.reading = value

    def value(self) -> float:
        return self.reading

    def observe(self, value: float) -> None:
        assert self.kind == "histogram"
        self.observed.append(value)


class FakeFamily:
    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[FakeMetric] = []

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:  # noqa: N802
        metric = FakeMetric(self.kind, labels, buckets)
        self.metrics.append(metric)
        return metric


@pytest.fixture
def families():
    created: dict[str, FakeFamily] = {}

    def make_family(name: str, description: str, kind: str) -> FakeFamily:
        created[name] = FakeFamily(name, description, kind)
        return created[name]

    metrics = TritonMetrics(make_family, {"model": "llm", "version": "1"}, MAX_MODEL_LEN, interval_s=0.01)
    yield metrics, created
    metrics.close()


def value(created: dict[str, FakeFamily], name: str) -> FakeMetric:
    return created[name].metrics[0]


def test_declares_vllm_backend_families_and_our_own(families) -> None:
    _, created = families
    vllm = {name for name in created if name.startswith("vllm:")}
    assert vllm == {"vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n",
                    # the model server protocol's (Gateway API Inference Extension)
                    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                    "vllm:cache_config_info", "vllm:lora_requests_info"}
    assert set(created) - vllm == {f"pagedllm:{name}" for name in (
        "num_preemptions_total", "engine_restarts_total", "kv_blocks_used", "kv_blocks_free")}
    assert created["vllm:time_to_first_token_seconds"].kind == "histogram"
    assert all(created[name].kind == "counter" for name in (
        "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))
    assert all(created[name].kind == "gauge" for name in (
        "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:cache_config_info", "vllm:lora_requests_info"))
    # The info gauges get their series (and labels) from the engine's first snapshot.
    assert created["vllm:cache_config_info"].metrics == [] and created["vllm:lora_requests_info"].metrics == []
    del created["vllm:cache_config_info"], created["vllm:lora_requests_info"]
    assert created["vllm:request_params_n"].description == "Histogram of the n request parameter."
    assert value(created, "vllm:e2e_request_latency_seconds").buckets == list(E2E_BUCKETS)
    assert value(created, "vllm:request_params_n").buckets == [1, 2, 5, 10, 20]
    assert value(created, "vllm:request_prompt_tokens").buckets == [1, 2, 5, 10, 20, 50, 100, 200]
    assert all(family.metrics[0].labels == {"model": "llm", "version": "1"} for family in created.values())


def test_one_two_five_buckets_stop_at_the_limit() -> None:
    assert one_two_five_buckets(1) == (1,)
    assert one_two_five_buckets(4) == (1, 2)
    assert one_two_five_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert [s.buckets for s in metric_specs(50) if s.name == "vllm:request_generation_tokens"] == [
        (1, 2, 5, 10, 20, 50)]


def test_counters_follow_cumulative_stats_and_gauges_the_latest_snapshot(families) -> None:
    metrics, created = families
    metrics.record(Stats(num_blocks_free=60, prompt_tokens_total=10, generation_tokens_total=3, num_running=2,
                         prefix_cache_queried_tokens=8, prefix_cache_hit_tokens=2, num_preemptions=1), StepTimings())
    metrics.record(Stats(num_blocks_free=100, prompt_tokens_total=25, generation_tokens_total=9, num_preemptions=1,
                         prefix_cache_queried_tokens=20, prefix_cache_hit_tokens=10), StepTimings())
    metrics.close()
    assert value(created, "vllm:prompt_tokens_total").reading == 25
    assert value(created, "vllm:generation_tokens_total").reading == 9
    assert value(created, "pagedllm:num_preemptions_total").reading == 1
    assert value(created, "pagedllm:kv_blocks_used").reading == 0
    assert value(created, "pagedllm:kv_blocks_free").reading == 100
    assert value(created, "vllm:kv_cache_usage_perc").reading == 0
    assert value(created, "vllm:num_requests_running").reading == 0
    assert value(created, "vllm:prefix_cache_queries_total").reading == 20
    assert value(created, "vllm:prefix_cache_hits_total").reading == 10
    config = value(created, "vllm:cache_config_info")
    assert config.reading == 1 and config.labels == {"model": "llm", "version": "1", "block_size": "16",
                                                     "num_gpu_blocks": "100", "enable_prefix_caching": "True"}
    assert created["vllm:lora_requests_info"].metrics == []  # an engine without LoRA has none


def test_lora_requests_info_follows_the_adapters_with_the_time_of_the_update(families) -> None:
    metrics, created = families
    before = time.time()
    metrics.record(Stats(max_loras=2, running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",)), StepTimings())
    metrics.close()
    (series,) = created["vllm:lora_requests_info"].metrics
    assert series.labels == {"model": "llm", "version": "1", "max_lora": "2", "running_lora_adapters": "a,b",
                             "waiting_lora_adapters": "c"}
    assert before <= series.reading <= time.time()


def test_token_latencies_are_observed_as_they_happen_and_finished_requests_once(families) -> None:
    metrics, created = families
    metrics.record(Stats(), StepTimings(first_token_latencies=[0.5, 0.125]))
    metrics.record(Stats(), StepTimings(inter_token_latencies=[0.25, 0.75]))
    metrics.close(timeout_s=10)
    assert value(created, "vllm:time_to_first_token_seconds").observed == [0.5, 0.125]
    assert value(created, "vllm:time_per_output_token_seconds").observed == [0.25, 0.75]
    assert value(created, "vllm:e2e_request_latency_seconds").observed == []


def test_each_finished_request_is_one_observation(families) -> None:
    metrics, created = families
    two_samples = RequestTiming("r", arrival=1.0, first_token=1.5, last_token=3.5, finished=4.0, num_prompt_tokens=5,
                                num_output_tokens=10, num_token_steps=5, finish_reasons=("length", "length"), n=2)
    aborted = RequestTiming("a", arrival=2.0, first_token=None, last_token=None, finished=2.25, num_prompt_tokens=7,
                            num_output_tokens=0, num_token_steps=0, finish_reasons=("abort",))
    metrics.record(Stats(), StepTimings([two_samples, aborted]))
    metrics.close()
    assert value(created, "vllm:time_to_first_token_seconds").observed == []
    assert value(created, "vllm:e2e_request_latency_seconds").observed == [3.0, 0.25]
    assert value(created, "vllm:request_prompt_tokens").observed == [5, 7]
    assert value(created, "vllm:request_generation_tokens").observed == [10, 0]
    assert value(created, "vllm:request_params_n").observed == [2, 1]


def test_engine_restarts_count_only_what_is_missing(families) -> None:
    metrics, created = families
    counter = value(created, "pagedllm:engine_restarts_total")
    counter.reading = 2.0  # what a reloaded model inherits from its still-resident predecessor
    metrics.count_restarts(3)
    assert counter.reading == 3
    metrics.count_restarts(3)
    assert counter.reading == 3


def test_gauge_values_of_a_busy_cache() -> None:
    gauges = gauge_values(Stats(num_blocks_total=8, num_blocks_free=2, num_running=3, num_waiting=4))
    assert gauges == {"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 4,
                      "pagedllm:kv_blocks_used": 6, "pagedllm:kv_blocks_free": 2,
                      "vllm:kv_cache_usage_perc": 0.75}


@pytest.mark.parametrize(("parameters", "enabled"), [
    ({}, True),
    ({"REPORT_CUSTOM_METRICS": {"string_value": "true"}}, True),
    ({"REPORT_CUSTOM_METRICS": {"string_value": "False"}}, False),
    ({"REPORT_CUSTOM_METRICS": {"string_value": "false"}}, False),
])
def test_the_switch_is_on_unless_false(parameters: dict[str, object], enabled: bool) -> None:
    assert custom_metrics_enabled({"parameters": parameters}) is enabled


def test_a_switch_value_that_is_neither_true_nor_false_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match='REPORT_CUSTOM_METRICS=.*"true" or "false"'):
        custom_metrics_enabled({"parameters": {"REPORT_CUSTOM_METRICS": {"string_value": "yes"}}})


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from pagedllm.core.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", device="cpu",
                                  max_model_len=128, num_kv_blocks=64))


def run(engine, request_id: str, prompt: str, params, *, abort_after_steps: int | None = None) -> list:
    from pagedllm.engine.outputs import FinalOutput

    engine.add_request(request_id, prompt, params)
    final, steps = None, 0
    while engine.has_request(request_id):
        if steps == abort_after_steps:
            engine.abort_request(request_id)
        for output in engine.step():
            final = final or FinalOutput.start(output, params.n)
            final.add(output)
        steps += 1
    return final.outputs


def test_the_engine_counts_each_prompt_once_and_every_computed_token(engine) -> None:
    from pagedllm import SamplingParams

    prompt = "def f(x): return"
    prompt_len = len(engine.tokenizer(prompt)["input_ids"])
    before = engine.stats()
    samples = run(engine, "n2", prompt, SamplingParams(n=2, seed=3, max_tokens=4, ignore_eos=True))
    after = engine.stats()
    assert [len(s.token_ids) for s in samples] == [4, 4]
    assert after.prompt_tokens_total - before.prompt_tokens_total == prompt_len  # the samples share it
    assert after.generation_tokens_total - before.generation_tokens_total == 8

    before = after
    beams = run(engine, "beam", prompt, SamplingParams(beam_width=3, n=2, temperature=0, max_tokens=5, ignore_eos=True))
    after = engine.stats()
    assert [len(b.token_ids) for b in beams] == [5, 5]
    assert after.prompt_tokens_total - before.prompt_tokens_total == prompt_len
    assert after.generation_tokens_total - before.generation_tokens_total == 1 + 3 * 4  # every live beam, each step

    before = after
    cancelled = run(engine, "beam-cancelled", prompt,
                    SamplingParams(beam_width=3, temperature=0, max_tokens=50, ignore_eos=True), abort_after_steps=3)
    after = engine.stats()
    assert [b.finish_reason for b in cancelled] == ["abort"]
    assert after.prompt_tokens_total - before.prompt_tokens_total == prompt_len  # computed before the cancel
    assert 1 <= after.generation_tokens_total - before.generation_tokens_total < 1 + 3 * 49
