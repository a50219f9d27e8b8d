"""vLLM's speculative-decoding counters on Triton's metrics, from a real engine's counts: they add up, and a
model without speculation exports none of them."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from test_triton_metrics import FakeFamily  # noqa: E402

from pagedllm import LLM, SamplingParams
from pagedllm.engine.request_timing import StepTimings
from pagedllm.serving.triton.metrics import TritonMetrics

K = 3
DASHBOARD = Path(__file__).resolve().parents[1] / "client_examples" / "grafana" / "pagedllm-dashboard.json"
SPEC_SERIES = {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
               "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"}


def publish(stats: object, positions: int) -> dict[str, FakeFamily]:
    created: dict[str, FakeFamily] = {}

    def make_family(name: str, description: str, kind: str) -> FakeFamily:
        created[name] = FakeFamily(name, description, kind)
        return created[name]

    metrics = TritonMetrics(make_family, {"model": "llm", "version": "1"}, 256, positions, interval_s=0.01)
    metrics.record(stats, StepTimings())
    metrics.close()
    return created


def test_spec_decode_counters_add_up() -> None:
    # The embedded model (trained on Python sources) copies code it has seen: drafts get accepted.
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    prompts = ["def area(width, height):\n    return width * height\n\n\ndef area(",
               "import os\nimport sys\n\nfor name in sys.argv:\n    print(os.path.basename(name))\nfor name in "]
    llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    counts = llm.stats().spec_decode
    assert counts is not None and counts.num_accepted_tokens > 0
    created = publish(llm.stats(), K)
    assert SPEC_SERIES <= set(created)
    assert all(created[name].kind == "counter" for name in SPEC_SERIES)
    drafts, draft_tokens, accepted = (created[f"vllm:spec_decode_{name}"].metrics[0].reading
                                      for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    assert (drafts, draft_tokens, accepted) == (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens)
    assert accepted <= draft_tokens <= K * drafts
    per_position = created["vllm:spec_decode_num_accepted_tokens_per_pos"].metrics
    assert [m.labels for m in per_position] == [{"model": "llm", "version": "1", "position": str(i)} for i in range(K)]
    assert [m.reading for m in per_position] == counts.num_accepted_tokens_per_pos
    assert sum(m.reading for m in per_position) == accepted
    # A later snapshot adds only its increase.
    created_again = publish(llm.stats(), K)
    assert created_again["vllm:spec_decode_num_drafts"].metrics[0].reading == drafts


def test_the_dashboard_queries_these_series_by_name() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    named = {name for query in queries for name in re.findall(r"\b(vllm:spec_decode_[a-z_]+)", query)}
    assert named == SPEC_SERIES


def test_no_speculation_no_spec_decode_series(tiny_model_dir: Callable[[str], Path]) -> None:
    llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32")
    assert llm.stats().spec_decode is None
    assert not SPEC_SERIES & set(publish(llm.stats(), 0))
