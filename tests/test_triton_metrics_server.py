"""vllm_backend's metrics on a real tritonserver: names, kinds, help texts, labels, buckets and exact counts.

One server for the module, serving the bundled config twice: ``llm`` (metrics on, as
shipped) and ``llm_quiet`` (``REPORT_CUSTOM_METRICS: "false"``). The shipped Grafana
dashboard is checked against what this server exports.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from installed import need
need("tritonclient.grpc")

from test_triton_server import MODEL, StreamClient, greedy, make_inputs, stream_once  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from pagedllm.serving.server import TritonServer  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

REPO_ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = REPO_ROOT / "client_examples" / "grafana" / "pagedllm-dashboard.json"
QUIET = "llm_quiet"
MAX_MODEL_LEN = 128
LABELS = {"model": MODEL, "version": "1"}

# vllm_backend's series (src/utils/metrics.py): kind, help text, bucket boundaries (token histograms: 1-2-5 up to
# max_model_len, vLLM's build_1_2_5_buckets).
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100]
VLLM_SERIES = {
    "vllm:prompt_tokens_total": ("counter", "Number of prefill tokens processed.", None),
    "vllm:generation_tokens_total": ("counter", "Number of generation tokens processed.", None),
    "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds.",
                                         [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                          5.0, 7.5, 10.0]),
    "vllm:time_per_output_token_seconds": ("histogram", "Histogram of time per output token in seconds.",
                                           [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]),
    "vllm:e2e_request_latency_seconds": ("histogram", "Histogram of end to end request latency in seconds.",
                                         [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]),
    "vllm:request_prompt_tokens": ("histogram", "Number of prefill tokens processed.", TOKEN_BUCKETS),
    "vllm:request_generation_tokens": ("histogram", "Number of generation tokens processed.", TOKEN_BUCKETS),
    "vllm:request_params_n": ("histogram", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]),
}
# The model server protocol's series (Gateway API Inference Extension), under vLLM's names, kinds and help texts;
# vllm:lora_requests_info exists only on an engine with LoRA.
PROTOCOL_SERIES = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:cache_config_info": ("gauge", "Information of the LLMEngine CacheConfig"),
}
# vLLM v1's prefix-cache counters (vllm/v1/metrics/loggers.py): in tokens, once per request at its admission.
PREFIX_CACHE_SERIES = {
    "vllm:prefix_cache_queries_total": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits_total": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
}
OWN_SERIES = {"pagedllm:num_preemptions_total", "pagedllm:engine_restarts_total", "pagedllm:kv_blocks_used",
              "pagedllm:kv_blocks_free", *PROTOCOL_SERIES, *PREFIX_CACHE_SERIES}
PER_REQUEST = ("vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
               "vllm:request_params_n", "vllm:time_to_first_token_seconds")


@dataclass
class Scrape:
    """One read of /metrics: kinds and help texts by family, sample values by (name, labels)."""

    kinds: dict[str, str] = field(default_factory=dict)
    helps: dict[str, str] = field(default_factory=dict)
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)

    def value(self, name: str, model: str = MODEL, **extra: str) -> float:
        return self.samples.get((name, frozenset({**LABELS, "model": model, **extra}.items())), 0.0)

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def of_model(self, model: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return {key: value for key, value in self.samples.items() if ("model", model) in key[1]}


def scrape(server: TritonServer) -> Scrape:
    result = Scrape()
    for line in requests.get(server.metrics_url, timeout=10).text.splitlines():
        if line.startswith("# HELP "):
            name, _, text = line[len("# HELP "):].partition(" ")
            result.helps[name] = text
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE "):].partition(" ")
            result.kinds[name] = kind
        elif line and not line.startswith("#"):
            match = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: \d+)?', line)
            assert match, f"unparsable metrics line {line!r}"
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            result.samples[(match.group(1), labels)] = float(match.group(3))
    return result


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp("model_repository")
    engine_args = {"model": str(tiny_model_dir("llama")), "dtype": "float32", "device": "cpu",
                   "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64, "block_size": 16}
    bundled = (REPO_ROOT / "model_repository" / MODEL / "config.pbtxt").read_text()
    switch = 'key: "REPORT_CUSTOM_METRICS"\n  value: { string_value: "true" }'
    assert switch in bundled, "the shipped config.pbtxt states the switch explicitly"
    configs = {MODEL: bundled, QUIET: bundled.replace(switch, switch.replace('"true"', '"false"'))}
    for name, config in configs.items():
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(config)
        # The quiet model runs its engine on a thread: the switch does not care, and the server starts sooner.
        args = {**engine_args, "engine_process": name != QUIET}
        (repository / name / "1" / "model.json").write_text(json.dumps(args))
    log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    with TritonServer(repository, log_path=log, extra_args=["--exit-timeout-secs=20"]) as running:
        yield running
        print(running.log_tail(3000))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Callable[[str], Path]):
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def settled(server: TritonServer, done: Callable[[Scrape], bool], timeout_s: float = 60) -> Scrape:
    """The scrape once ``done`` holds and nothing runs (metrics are published just after the step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = scrape(server)
        if done(current) and current.value("vllm:num_requests_running") == 0:
            return current
        assert time.monotonic() < deadline, "metrics did not settle: " + ", ".join(
            f"{name} {value:g}" for (name, _), value in sorted(current.of_model(MODEL).items())
            if not name.endswith("_bucket"))
        time.sleep(0.2)


def one_request_settled(server: TritonServer) -> Scrape:
    """The scrape once one short request's metrics are in. Settled on its own count, not on "some request
    counted": a test that returns before its request is published leaves the next test a stale baseline
    (CI once saw the prefix-cache test's delta include such a request, so it never settled)."""
    before = scrape(server)
    stream_once(server.grpc_url, "return", greedy(2), stream=True)
    return settled(server, lambda s: s.value("vllm:e2e_request_latency_seconds_count")
                   - before.value("vllm:e2e_request_latency_seconds_count") == 1)


def test_known_requests_add_up_under_vllm_backend_names(server: TritonServer, tokenizer) -> None:
    before = scrape(server)
    prompts = ["def main(self, value):", "import os", "class Foo", "while True: print", "lambda x"]
    # The stream to cancel goes first and is cancelled at its first token, long before its 100th.
    cancelled_client = StreamClient(server.grpc_url)
    try:
        cancelled = cancelled_client.send("d", make_inputs(prompts[3], greedy(100, ignore_eos=True), stream=True,
                                                           return_num_output_tokens=True))
        deadline = time.monotonic() + 60
        while not cancelled.texts and time.monotonic() < deadline:
            time.sleep(0.005)
        assert cancelled.texts, "the stream to cancel never produced a token"
    finally:
        cancelled_client.close(cancel=True)
    client = StreamClient(server.grpc_url)
    try:
        finished = [
            client.send("a", make_inputs(prompts[0], greedy(5, ignore_eos=True), stream=True)),
            client.send("b", make_inputs(prompts[1], greedy(3, ignore_eos=True), stream=False)),
            client.send("c", make_inputs(prompts[2], {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 4,
                                                      "ignore_eos": True}, stream=False)),
            # 5 steps: the prompt's 1 token, then 3 live beams' 4 times; 2 hypotheses of 5 tokens come back.
            client.send("e", make_inputs(prompts[4], greedy(5, ignore_eos=True, beam_width=3, n=2), stream=False,
                                         return_num_output_tokens=True)),
        ]
        assert all(result.done.wait(120) and result.error is None for result in finished)
    finally:
        client.close()
    received = sum(int(a["num_output_tokens"][0]) for a in cancelled.arrays)

    def delta(name: str, **extra: str) -> float:
        return after.value(name, **extra) - before.value(name, **extra)

    assert finished[3].arrays[0]["num_output_tokens"].tolist() == [5, 5]
    after = settled(server, lambda s: s.value("vllm:e2e_request_latency_seconds_count")
                    - before.value("vllm:e2e_request_latency_seconds_count") == 5)
    for name in PER_REQUEST:
        assert delta(f"{name}_count") == 5, name
    prompt_tokens = sum(len(tokenizer(prompt)["input_ids"]) for prompt in prompts)
    assert delta("vllm:prompt_tokens_total") == prompt_tokens == delta("vllm:request_prompt_tokens_sum")
    # Each request one prefix-cache query of its prompt (the n=2 samples and the beams share its admission).
    assert delta("vllm:prefix_cache_queries_total") == prompt_tokens
    returned = delta("vllm:request_generation_tokens_sum")
    # The counter counts what the engine computed: the beam search's pruned beams too.
    assert delta("vllm:generation_tokens_total") == returned + (1 + 3 * 4) - 2 * 5
    cancelled_tokens = returned - (5 + 3 + 2 * 4 + 2 * 5)
    assert received <= cancelled_tokens < 100, (received, cancelled_tokens)
    # One gap per token-producing step after the first: the n=2 request's samples step together, and a
    # beam search produces its tokens in one output at the end.
    assert delta("vllm:time_per_output_token_seconds_count") == (5 - 1) + (3 - 1) + (4 - 1) + (cancelled_tokens - 1)
    assert delta("vllm:request_params_n_sum") == 1 + 1 + 2 + 1 + 2
    assert delta("vllm:request_params_n_bucket", le="1") == 3 and delta("vllm:request_params_n_bucket", le="2") == 5
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta("vllm:time_to_first_token_seconds_sum") > 0


def test_every_vllm_backend_series_has_its_name_kind_help_labels_and_buckets(server: TritonServer) -> None:
    current = one_request_settled(server)  # histograms with observations
    for name, (kind, help_text, buckets) in VLLM_SERIES.items():
        assert current.kinds.get(name) == kind, name
        assert current.helps.get(name) == help_text, name
        suffixes = ("_count", "_sum", "_bucket") if kind == "histogram" else ("",)
        for suffix in suffixes:
            label_sets = [dict(labels) for sample, labels in current.of_model(MODEL) if sample == name + suffix]
            assert label_sets, f"{name}{suffix} is missing"
            for labels in label_sets:
                assert {k: v for k, v in labels.items() if k != "le"} == LABELS, (name, labels)
        if buckets is not None:
            bounds = sorted(float(dict(labels)["le"]) for sample, labels in current.of_model(MODEL)
                            if sample == f"{name}_bucket")
            assert bounds == [float(b) for b in buckets] + [float("inf")], name
            assert current.value(f"{name}_bucket", le="+Inf") == current.value(f"{name}_count")
    families = {name for name in current.kinds if name.startswith(("vllm:", "pagedllm:"))}
    families.discard("vllm:lora_requests_info")  # declared, with no series on this engine without LoRA
    assert families == set(VLLM_SERIES) | OWN_SERIES, "a quantity is reported under two names, or one is missing"


def test_the_model_server_protocol_series_agree_with_the_engine(server: TritonServer) -> None:
    current = one_request_settled(server)
    for name, (kind, help_text) in PROTOCOL_SERIES.items():
        assert (current.kinds.get(name), current.helps.get(name)) == (kind, help_text), name
    (config,) = [dict(labels) for sample, labels in current.of_model(MODEL) if sample == "vllm:cache_config_info"]
    assert config == {**LABELS, "block_size": "16", "num_gpu_blocks": "64", "enable_prefix_caching": "True"}
    assert current.value("vllm:cache_config_info", **{k: v for k, v in config.items() if k not in LABELS}) == 1
    assert current.value("vllm:num_requests_waiting") == 0
    used = current.value("pagedllm:kv_blocks_used")
    assert current.value("vllm:kv_cache_usage_perc") == used / 64
    assert not [sample for sample, _ in current.of_model(MODEL) if sample == "vllm:lora_requests_info"]


def test_prefix_cache_counters_count_each_prompt_once_and_its_cached_blocks(server: TritonServer, tokenizer) -> None:
    prompt = "A prompt long enough to fill a few blocks of sixteen tokens: " + "metrics count tokens " * 8
    num_tokens = len(tokenizer(prompt)["input_ids"])
    before = scrape(server)
    for _ in range(2):  # one after the other: the second finds the first's full blocks
        assert stream_once(server.grpc_url, prompt, greedy(2), stream=False).error is None
    after = settled(server, lambda s: s.value("vllm:prefix_cache_queries_total")
                    - before.value("vllm:prefix_cache_queries_total") == 2 * num_tokens)
    for name, (kind, help_text) in PREFIX_CACHE_SERIES.items():
        assert (after.kinds.get(name), after.helps.get(name)) == (kind, help_text), name
    # The last prompt token is never matched (its logits are needed): whole blocks before it.
    hits = after.value("vllm:prefix_cache_hits_total") - before.value("vllm:prefix_cache_hits_total")
    assert hits == (num_tokens - 1) // 16 * 16 > 0


def test_report_custom_metrics_false_silences_the_model_and_it_still_serves(server: TritonServer) -> None:
    client = StreamClient(server.grpc_url)
    try:
        result = client.send("q", make_inputs("def", greedy(4, ignore_eos=True), stream=True,
                                              return_num_output_tokens=True), model=QUIET)
        assert result.done.wait(120)
    finally:
        client.close()
    assert result.error is None and result.text()
    assert sum(int(a["num_output_tokens"][0]) for a in result.arrays) == 4
    current = scrape(server)
    quiet = [name for name, _ in current.of_model(QUIET) if name.startswith(("vllm:", "pagedllm:"))]
    assert quiet == []
    assert current.of_model(MODEL), "the other model's series are still there"
    assert any(name.startswith("nv_inference_request_success") for name, _ in current.of_model(QUIET))


def test_the_grafana_dashboard_names_only_exported_series(server: TritonServer) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    named = {name for query in queries for name in re.findall(r"\b((?:vllm|pagedllm):[a-z0-9_]+)", query)}
    exported = scrape(server).names()
    # Exported only by a model with speculative_config (tests/test_spec_decode_metrics.py checks those names).
    spec_decode = {name for name in named if name.startswith("vllm:spec_decode_")}
    assert named - exported - spec_decode == set(), "the dashboard queries series the server does not export"
    families = {re.sub(r"_(bucket|sum|count)$", "", name) if name.startswith("vllm:") else name for name in named}
    assert set(VLLM_SERIES) <= families, "every vllm_backend series has a panel"
    assert {"vllm:kv_cache_usage_perc", "pagedllm:kv_blocks_used", "pagedllm:kv_blocks_free"} <= families
    assert all('model=~"$model"' in query for query in queries if "label_values" not in query)
