"""Engine metrics on Triton's /metrics: vllm_backend's series under its own names, ours under ``pagedllm:``.

The ``vllm:`` family is the one Triton's vLLM backend exports (same names, kinds,
help texts, labels ``model`` and ``version``, bucket boundaries), so its dashboards
and alerts work unchanged:

- counters ``vllm:prompt_tokens_total`` (each request's prompt tokens, counted once when
  its prompt has been computed) and ``vllm:generation_tokens_total`` (tokens the engine
  sampled, every sample of an ``n > 1`` request and every live beam of a beam search),
  both raised step by step from the engine's cumulative counts;
- counters ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (vLLM v1's prefix-cache
  counters, in tokens, counted as vLLM counts them: once when a request is first admitted, its tokens then
  and the tokens its cached blocks cover; a re-admission after preemption, and a prompt-logprobs request,
  which skips the cache, count nothing). The hit rate is
  ``rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])``;
- per finished request (a Triton request, whatever its ``n``; cancelled ones included):
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens`` (over all samples; beam search: the tokens of
  the hypotheses returned), ``vllm:request_params_n``;
- as they happen (``StepTimings``): ``vllm:time_to_first_token_seconds`` at a request's
  first token, ``vllm:time_per_output_token_seconds`` at each later token-producing step,
  its gap since the request's previous one (vLLM's inter-token latencies).

What routers and endpoint pickers read, under vLLM's own names, as the Gateway API Inference
Extension's model server protocol lists them: gauges ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (a fraction in [0, 1], as vLLM's),
``vllm:cache_config_info`` (value 1; labels ``block_size``, ``num_gpu_blocks`` (the KV cache's
blocks, on whatever device), ``enable_prefix_caching``) and, on an engine with LoRA,
``vllm:lora_requests_info`` (value: the time of the last update, so a reader takes the newest
series; labels ``max_lora``, ``running_lora_adapters``, ``waiting_lora_adapters``, the adapter
names comma separated, as vLLM's).

With ``speculative_config``, vLLM's speculative-decoding counters (its v1 names): ``vllm:spec_decode_num_drafts``
(verifications of a sample holding drafted tokens), ``vllm:spec_decode_num_draft_tokens``,
``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos`` (label
``position``, 0 to k-1: drafts accepted at that position). The acceptance rate is
``rate(vllm:spec_decode_num_accepted_tokens[5m]) / rate(vllm:spec_decode_num_draft_tokens[5m])``, the mean
acceptance length (tokens per verifying step, the bonus token included)
``1 + rate(vllm:spec_decode_num_accepted_tokens[5m]) / rate(vllm:spec_decode_num_drafts[5m])``.

Our own series, which vLLM does not have under these meanings: counters
``pagedllm:num_preemptions_total`` and ``pagedllm:engine_restarts_total`` (restarts of this model
by ``pagedllm serve``'s supervisor, which keeps the count across the restarts; see
``serving.supervision``); gauges ``pagedllm:kv_blocks_used`` and ``pagedllm:kv_blocks_free``. No quantity
is reported under two names.

``REPORT_CUSTOM_METRICS`` in config.pbtxt turns all of them off with ``"false"``, as in
vllm_backend (which defaults to off; we default to on).

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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.request_timing import StepTimings

log = logging.getLogger(__name__)

VLLM_PREFIX = "vllm:"
PREFIX = "pagedllm:"
SWITCH_PARAMETER = "REPORT_CUSTOM_METRICS"
FamilyFactory = Callable[[str, str, str], Any]
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LORA_REQUESTS_INFO = "vllm:lora_requests_info"

# vllm_backend's boundaries (src/utils/metrics.py), which its dashboards' `le` labels name.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


def one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's ``build_1_2_5_buckets`` (token-count histograms)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # the full series name
    description: str
    kind: str
    buckets: tuple[float, ...] | None = None
    info: bool = False  # an info gauge: its labels come from the engine, set when it publishes


def metric_specs(max_model_len: int) -> tuple[MetricSpec, ...]:
    """Every family a model exports; the token-count histograms' buckets reach ``max_model_len``."""
    tokens = one_two_five_buckets(max_model_len)
    return (
        MetricSpec("vllm:prompt_tokens_total", "Number of prefill tokens processed.", "counter"),
        MetricSpec("vllm:generation_tokens_total", "Number of generation tokens processed.", "counter"),
        MetricSpec("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
                   "counter"),
        MetricSpec("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
                   "counter"),
        MetricSpec("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "histogram",
                   TTFT_BUCKETS),
        MetricSpec("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                   "histogram", TPOT_BUCKETS),
        MetricSpec("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                   "histogram", E2E_BUCKETS),
        MetricSpec("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "histogram", tokens),
        MetricSpec("vllm:request_generation_tokens", "Number of generation tokens processed.", "histogram", tokens),
        MetricSpec("vllm:request_params_n", "Histogram of the n request parameter.", "histogram", N_BUCKETS),
        MetricSpec("pagedllm:num_preemptions_total", "Cumulative number of preemptions (recompute) in the engine.",
                   "counter"),
        MetricSpec("pagedllm:engine_restarts_total", "Times pagedllm serve restarted this model after its engine died.",
                   "counter"),
        MetricSpec("vllm:num_requests_running", "Number of requests in model execution batches.", "gauge"),
        MetricSpec("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "gauge"),
        MetricSpec("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge"),
        MetricSpec(CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", "gauge", info=True),
        MetricSpec(LORA_REQUESTS_INFO, "Running stats on lora requests.", "gauge", info=True),
        MetricSpec("pagedllm:kv_blocks_used", "KV-cache blocks referenced by requests.", "gauge"),
        MetricSpec("pagedllm:kv_blocks_free",
                   "KV-cache blocks free (including cached prefix blocks that can be revived).", "gauge"),
    )


SPEC_DECODE_SPECS = (
    MetricSpec("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "counter"),
    MetricSpec("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "counter"),
    MetricSpec("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "counter"),
)
SPEC_DECODE_PER_POSITION = MetricSpec("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", "counter")
# spec-decode counter series -> the cumulative SpecDecodeCounts field it follows
_SPEC_DECODE_SOURCES = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}

# counter series -> the cumulative EngineStats field it follows
_COUNTER_SOURCES = {
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:prefix_cache_queries_total": "prefix_cache_queried_tokens",
    "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens",
    "pagedllm:num_preemptions_total": "num_preemptions",
}


def custom_metrics_enabled(model_config: Mapping[str, Any]) -> bool:
    """``REPORT_CUSTOM_METRICS`` of a model's config (Triton's JSON form): on unless ``"false"``.

    vllm_backend reads the same parameter (``"true"``/``"false"``, any case) but defaults to off.
    """
    parameter = model_config.get("parameters", {}).get(SWITCH_PARAMETER)
    if parameter is None:
        return True
    value = str(parameter.get("string_value", "")).strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f'config.pbtxt parameter {SWITCH_PARAMETER}={parameter.get("string_value")!r} is invalid: '
                         'expected "true" or "false"')
    return value == "true"


def gauge_values(stats: Any) -> dict[str, float]:
    """The gauge readings for one ``EngineStats`` snapshot."""
    total = stats.num_blocks_total
    used = total - stats.num_blocks_free
    return {
        "vllm:num_requests_running": float(stats.num_running),
        "vllm:num_requests_waiting": float(stats.num_waiting),
        "vllm:kv_cache_usage_perc": used / total if total else 0.0,
        "pagedllm:kv_blocks_used": float(used),
        "pagedllm:kv_blocks_free": float(stats.num_blocks_free),
    }


def info_labels(stats: Any) -> dict[str, dict[str, str]]:
    """The labels of each info gauge for one ``EngineStats`` snapshot (none for LoRA without LoRA)."""
    labels = {CACHE_CONFIG_INFO: {"block_size": str(stats.block_size), "num_gpu_blocks": str(stats.num_blocks_total),
                                  "enable_prefix_caching": str(stats.enable_prefix_caching)}}
    if stats.max_loras:
        labels[LORA_REQUESTS_INFO] = {"max_lora": str(stats.max_loras),
                                      "running_lora_adapters": ",".join(stats.running_lora_adapters),
                                      "waiting_lora_adapters": ",".join(stats.waiting_lora_adapters)}
    return labels


def step_observations(timings: StepTimings) -> list[tuple[str, float]]:
    """The histogram observations of one engine step, as (series, value)."""
    observed = [("vllm:time_to_first_token_seconds", latency) for latency in timings.first_token_latencies]
    observed.extend(("vllm:time_per_output_token_seconds", gap) for gap in timings.inter_token_latencies)
    for timing in timings.finished:
        observed += [
            ("vllm:e2e_request_latency_seconds", timing.e2e_latency),
            ("vllm:request_prompt_tokens", float(timing.num_prompt_tokens)),
            ("vllm:request_generation_tokens", float(timing.num_output_tokens)),
            ("vllm:request_params_n", float(timing.n)),
        ]
    return observed


class TritonMetrics:
    """Publishes engine snapshots and finished-request timings to Triton metric families."""

    def __init__(self, make_family: FamilyFactory, labels: Mapping[str, str], max_model_len: int,
                 speculative_positions: int = 0, interval_s: float = 0.1) -> None:
        """``speculative_positions``: the engine's ``num_speculative_tokens``; 0 (speculation off) leaves the
        ``vllm:spec_decode_*`` series out, as vLLM does."""
        specs = metric_specs(max_model_len) + (SPEC_DECODE_SPECS if speculative_positions else ())
        # Families must stay referenced: Triton drops a family's metrics when it is garbage collected.
        self._families = {s.name: make_family(s.name, s.description, s.kind) for s in specs}
        self._labels = dict(labels)
        self._metrics = {
            s.name: (self._families[s.name].Metric(labels=dict(labels), buckets=list(s.buckets))
                     if s.buckets else self._families[s.name].Metric(labels=dict(labels)))
            for s in specs if not s.info
        }
        self._per_position: list[Any] = []
        if speculative_positions:
            family = make_family(SPEC_DECODE_PER_POSITION.name, SPEC_DECODE_PER_POSITION.description, "counter")
            self._families[SPEC_DECODE_PER_POSITION.name] = family
            self._per_position = [family.Metric(labels={**labels, "position": str(position)})
                                  for position in range(speculative_positions)]
        self._published_spec = dict.fromkeys(_SPEC_DECODE_SOURCES, 0)
        self._published_per_position = [0] * speculative_positions
        # Info gauges: the series of their current labels. When the labels change a new series takes over;
        # Triton keeps the old one on /metrics with its last value (for lora_requests_info, the time of its
        # last update, so readers take the newest series, as they do with vLLM's).
        self._info: dict[str, tuple[dict[str, str], Any]] = {}
        self._interval_s = interval_s
        self._published_counters = dict.fromkeys(_COUNTER_SOURCES, 0)
        self._latest: Any = None
        self._steps: list[StepTimings] = []
        self._closing = False
        self._waiting_for_data = False  # only then does a record wake the publisher (see record)
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="pagedllm-metrics", daemon=True)
        self._thread.start()

    def count_restarts(self, restarts: int) -> None:
        """Bring the counter up to the supervisor's restart count (once, when a model instance starts).

        Triton hands a reloaded model the series its previous instance published when that
        instance is still resident (it stays until its last client stream closes), so the
        counter may already hold earlier restarts: only the difference is added.
        """
        counter = self._metrics["pagedllm:engine_restarts_total"]
        missing = restarts - int(counter.value())
        if missing > 0:
            counter.increment(missing)

    def record(self, stats: Any, timings: StepTimings) -> None:
        """Queue a snapshot and a step's timings (cheap; call it from the engine loop's ``on_step``).

        The publisher is woken only when it waits for data: during its pause between publishes a
        notify would only wake it to wait again, two thread switches per engine step for nothing."""
        with self._changed:
            self._latest = stats
            self._steps.append(timings)
            if self._waiting_for_data:
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
                self._waiting_for_data = True
                while self._latest is None and not self._steps and not self._closing:
                    self._changed.wait()
                self._waiting_for_data = False
                stats, self._latest = self._latest, None
                steps, self._steps = self._steps, []
                closing = self._closing
            try:
                self._publish(stats, steps)
            except Exception:
                log.exception("publishing metrics failed")
            if closing:
                return
            with self._changed:
                self._changed.wait_for(lambda: self._closing, timeout=self._interval_s)

    def _publish(self, stats: Any, steps: Sequence[StepTimings]) -> None:
        # Counters first: a scrape that sees a request's histogram entries also sees its tokens.
        if stats is not None:
            for name, source in _COUNTER_SOURCES.items():
                value = int(getattr(stats, source))
                increase = value - self._published_counters[name]
                if increase > 0:
                    self._metrics[name].increment(increase)
                    self._published_counters[name] = value
            for name, value in gauge_values(stats).items():
                self._metrics[name].set(value)
            spec = getattr(stats, "spec_decode", None)
            if spec is not None and self._per_position:
                self._publish_spec_decode(spec)
            self._publish_info(stats)
        for timings in steps:
            for name, value in step_observations(timings):
                self._metrics[name].observe(value)

    def _publish_spec_decode(self, spec: Any) -> None:
        for name, source in _SPEC_DECODE_SOURCES.items():
            value = int(getattr(spec, source))
            if value > self._published_spec[name]:
                self._metrics[name].increment(value - self._published_spec[name])
                self._published_spec[name] = value
        for position, (metric, value) in enumerate(zip(self._per_position, spec.num_accepted_tokens_per_pos)):
            if value > self._published_per_position[position]:
                metric.increment(value - self._published_per_position[position])
                self._published_per_position[position] = value
    def _publish_info(self, stats: Any) -> None:
        for name, labels in info_labels(stats).items():
            current = self._info.get(name)
            if current is None or current[0] != labels:
                metric = self._families[name].Metric(labels={**self._labels, **labels})
                self._info[name] = (labels, metric)
            else:
                metric = current[1]
            metric.set(time.time() if name == LORA_REQUESTS_INFO else 1.0)
