"""Engine metrics on Triton's /metrics, under vLLM's names with a ``pagedllm:`` prefix.

Counters: ``prompt_tokens_total``, ``generation_tokens_total``, ``num_preemptions_total``
(a counter, as in vLLM), ``engine_restarts_total`` (restarts of this model by
``pagedllm serve``'s supervisor, which keeps the count across the restarts; see
``serving.supervision``). Histograms (vLLM's buckets): ``time_to_first_token_seconds``,
``time_per_output_token_seconds`` (per finished request: the mean gap between its
token-producing steps; vLLM observes each gap), ``e2e_request_latency_seconds``.
Gauges: ``num_requests_running``, ``num_requests_waiting``, ``kv_blocks_used``,
``kv_blocks_free``, ``kv_cache_usage_perc`` (fraction in [0, 1], as vLLM's
``gpu_cache_usage_perc``), ``prefix_cache_hit_rate`` (hit / queried prompt tokens since start).

Triton is reached through a family factory so this file does not import
``triton_python_backend_utils``: ``make_family(name, description, kind)`` with kind
``"counter"``, ``"gauge"`` or ``"histogram"`` returns an object whose
``Metric(labels=..., buckets=...)`` has ``increment``/``set``/``observe``. Updates go
through a publisher thread so the engine loop never waits on Triton's IPC; the latest
engine snapshot is published at most every ``interval_s`` and always after the last step.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.request_timing import RequestTiming

log = logging.getLogger(__name__)

PREFIX = "pagedllm:"
FamilyFactory = Callable[[str, str, str], Any]

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # without the prefix
    description: str
    kind: str
    buckets: tuple[float, ...] | None = None


SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("prompt_tokens_total", "Number of prefill tokens processed.", "counter"),
    MetricSpec("generation_tokens_total", "Number of generation tokens processed.", "counter"),
    MetricSpec("num_preemptions_total", "Cumulative number of preemptions (recompute) in the engine.", "counter"),
    MetricSpec("engine_restarts_total", "Times pagedllm serve restarted this model after its engine died.", "counter"),
    MetricSpec("time_to_first_token_seconds", "Histogram of time to first token in seconds.", "histogram",
               _TTFT_BUCKETS),
    MetricSpec("time_per_output_token_seconds", "Histogram of time per output token in seconds.", "histogram",
               _TPOT_BUCKETS),
    MetricSpec("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", "histogram",
               _E2E_BUCKETS),
    MetricSpec("num_requests_running", "Number of requests currently running.", "gauge"),
    MetricSpec("num_requests_waiting", "Number of requests waiting to be processed.", "gauge"),
    MetricSpec("kv_blocks_used", "KV-cache blocks referenced by requests.", "gauge"),
    MetricSpec("kv_blocks_free", "KV-cache blocks free (including cached prefix blocks that can be revived).", "gauge"),
    MetricSpec("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge"),
    MetricSpec("prefix_cache_hit_rate", "Prefix-cache hit tokens / queried prompt tokens since start.", "gauge"),
)

# counter name -> the cumulative EngineStats field it follows
_COUNTER_SOURCES = {
    "prompt_tokens_total": "prompt_tokens_total",
    "generation_tokens_total": "generation_tokens_total",
    "num_preemptions_total": "num_preemptions",
}


def gauge_values(stats: Any) -> dict[str, float]:
    """The gauge readings for one ``EngineStats`` snapshot."""
    total = stats.num_blocks_total
    used = total - stats.num_blocks_free
    queried = stats.prefix_cache_queried_tokens
    return {
        "num_requests_running": float(stats.num_running),
        "num_requests_waiting": float(stats.num_waiting),
        "kv_blocks_used": float(used),
        "kv_blocks_free": float(stats.num_blocks_free),
        "kv_cache_usage_perc": used / total if total else 0.0,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_tokens / queried if queried else 0.0,
    }


class TritonMetrics:
    """Publishes engine snapshots and finished-request timings to Triton metric families."""

    def __init__(self, make_family: FamilyFactory, labels: Mapping[str, str], interval_s: float = 0.1) -> None:
        # Families must stay referenced: Triton drops a family's metrics when it is garbage collected.
        self._families = {s.name: make_family(PREFIX + s.name, s.description, s.kind) for s in SPECS}
        self._metrics = {
            s.name: (self._families[s.name].Metric(labels=dict(labels), buckets=list(s.buckets))
                     if s.buckets else self._families[s.name].Metric(labels=dict(labels)))
            for s in SPECS
        }
        self._interval_s = interval_s
        self._published_counters = dict.fromkeys(_COUNTER_SOURCES, 0)
        self._latest: Any = None
        self._timings: list[RequestTiming] = []
        self._closing = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="pagedllm-metrics", daemon=True)
        self._thread.start()

    def count_restarts(self, restarts: int) -> None:
        """Bring the counter up to the supervisor's restart count (once, when a model instance starts).

        Triton hands a reloaded model the series its previous instance published when that
        instance is still resident (it stays until its last client stream closes), so the
        counter may already hold earlier restarts: only the difference is added.
        """
        counter = self._metrics["engine_restarts_total"]
        missing = restarts - int(counter.value())
        if missing > 0:
            counter.increment(missing)

    def record(self, stats: Any, finished: Sequence[RequestTiming]) -> None:
        """Queue a snapshot (cheap; call it from the engine loop's ``on_step``)."""
        with self._changed:
            self._latest = stats
            self._timings.extend(finished)
            self._changed.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish what is pending and stop the publisher thread."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._latest is None and not self._timings and not self._closing:
                    self._changed.wait()
                stats, self._latest = self._latest, None
                timings, self._timings = self._timings, []
                closing = self._closing
            try:
                self._publish(stats, timings)
            except Exception:
                log.exception("publishing metrics failed")
            if closing:
                return
            with self._changed:
                self._changed.wait_for(lambda: self._closing, timeout=self._interval_s)

    def _publish(self, stats: Any, timings: Sequence[RequestTiming]) -> None:
        for timing in timings:
            if timing.time_to_first_token is not None:
                self._metrics["time_to_first_token_seconds"].observe(timing.time_to_first_token)
            if timing.time_per_output_token is not None:
                self._metrics["time_per_output_token_seconds"].observe(timing.time_per_output_token)
            self._metrics["e2e_request_latency_seconds"].observe(timing.e2e_latency)
        if stats is None:
            return
        for name, source in _COUNTER_SOURCES.items():
            value = int(getattr(stats, source))
            increase = value - self._published_counters[name]
            if increase > 0:
                self._metrics[name].increment(increase)
                self._published_counters[name] = value
        for name, value in gauge_values(stats).items():
            self._metrics[name].set(value)
