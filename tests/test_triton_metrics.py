"""Engine snapshots -> Triton metric families, through a fake family factory."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from pagedllm.engine.request_timing import RequestTiming
from pagedllm.serving.metrics import PREFIX, SPECS, TritonMetrics, gauge_values


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


class FakeMetric:
    def __init__(self, kind: str, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.kind, self.labels, self.buckets = kind, labels, buckets
        self.value = 0.0
        self.observed: list[float] = []

    def increment(self, value: float) -> None:
        assert self.kind == "counter" and value > 0
        self.value += value

    def set(self, value: float) -> None:
        assert self.kind == "gauge"
        self.value = value

    def observe(self, value: float) -> None:
        assert self.kind == "histogram"
        self.observed.append(value)


class FakeFamily:
    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind = name, kind
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

    metrics = TritonMetrics(make_family, {"model": "llm", "version": "1"}, interval_s=0.01)
    yield metrics, created
    metrics.close()


def value(created: dict[str, FakeFamily], name: str) -> FakeMetric:
    return created[PREFIX + name].metrics[0]


def test_declares_vllm_names_and_kinds(families) -> None:
    _, created = families
    assert set(created) == {PREFIX + s.name for s in SPECS}
    assert created["pagedllm:time_to_first_token_seconds"].kind == "histogram"
    assert created["pagedllm:prompt_tokens_total"].kind == "counter"
    assert created["pagedllm:kv_cache_usage_perc"].kind == "gauge"
    assert value(created, "e2e_request_latency_seconds").buckets[0] == 0.3
    assert value(created, "num_requests_running").labels == {"model": "llm", "version": "1"}


def test_counters_follow_cumulative_stats_and_gauges_the_latest_snapshot(families) -> None:
    metrics, created = families
    metrics.record(Stats(num_blocks_free=60, prompt_tokens_total=10, generation_tokens_total=3, num_running=2,
                         prefix_cache_queried_tokens=8, prefix_cache_hit_tokens=2, num_preemptions=1), [])
    metrics.record(Stats(num_blocks_free=100, prompt_tokens_total=25, generation_tokens_total=9, num_preemptions=1,
                         prefix_cache_queried_tokens=20, prefix_cache_hit_tokens=10), [])
    metrics.close()
    assert value(created, "prompt_tokens_total").value == 25
    assert value(created, "generation_tokens_total").value == 9
    assert value(created, "num_preemptions_total").value == 1
    assert value(created, "kv_blocks_used").value == 0
    assert value(created, "kv_blocks_free").value == 100
    assert value(created, "kv_cache_usage_perc").value == 0
    assert value(created, "num_requests_running").value == 0
    assert value(created, "prefix_cache_hit_rate").value == 0.5


def test_finished_requests_feed_the_histograms(families) -> None:
    metrics, created = families
    done = RequestTiming("r", arrival=1.0, first_token=1.5, last_token=3.5, finished=4.0, num_prompt_tokens=5,
                         num_output_tokens=5, num_token_steps=5, finish_reasons=("length",))
    aborted = RequestTiming("a", arrival=2.0, first_token=None, last_token=None, finished=2.25, num_prompt_tokens=5,
                            num_output_tokens=0, num_token_steps=0, finish_reasons=("abort",))
    metrics.record(Stats(), [done, aborted])
    metrics.close()
    assert value(created, "time_to_first_token_seconds").observed == [0.5]
    assert value(created, "time_per_output_token_seconds").observed == [0.5]
    assert value(created, "e2e_request_latency_seconds").observed == [3.0, 0.25]


def test_gauge_values_of_a_busy_cache() -> None:
    gauges = gauge_values(Stats(num_blocks_total=8, num_blocks_free=2, num_running=3, num_waiting=4))
    assert gauges == {"num_requests_running": 3, "num_requests_waiting": 4, "kv_blocks_used": 6, "kv_blocks_free": 2,
                      "kv_cache_usage_perc": 0.75, "prefix_cache_hit_rate": 0.0}
