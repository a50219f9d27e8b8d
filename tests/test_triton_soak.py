"""A bounded soak through the real server: 200 requests at concurrency 64, a KV pool that forces preemption.

Good streams, bad requests and client cancellations mid-stream are mixed. Every good
request must be token-exact against offline ``LLM.generate``; every bad one must get
an error; at the end no KV block is used, the engine preempted at least once, and the
server still answers exactly.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from installed import need
need("tritonclient.grpc")

from test_triton_server import StreamClient, make_inputs, settled_metrics, wait_for_metrics  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.serving.server import TritonServer  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

NUM_REQUESTS = 200
CONCURRENCY = 64
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 40  # 64 streams of ~3 blocks each cannot all fit: the scheduler must preempt
WORDS = ["def", "class", "import", "return", "while", "for", "print", "self", "value", "lambda", "yield", "try"]
BAD_PARAMS = (
    {"n": 65, "max_tokens": 4},
    {"temperature": "NaN"},
    {"stop_token_ids": [999_999], "min_tokens": 2},
    {"max_tokens": 0},
    {"max_tokens": 4, "best_of": 2},
)


@dataclass(frozen=True)
class Plan:
    kind: str  # "good", "bad" or "cancel"
    prompt: str
    params: dict[str, object]


@dataclass(frozen=True)
class Outcome:
    plan: Plan
    text: str
    num_tokens: int
    error: str | None


def make_plans(seed: int = 0) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(NUM_REQUESTS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) + f" v{i % 17}"
        roll = rng.random()
        if roll < 0.15:
            plans.append(Plan("bad", prompt, dict(rng.choice(BAD_PARAMS))))
        elif roll < 0.3:
            plans.append(Plan("cancel", prompt, {"temperature": 0, "max_tokens": 200, "ignore_eos": True}))
        else:
            params: dict[str, object] = {"temperature": 0, "max_tokens": rng.randint(4, 40)}
            if rng.random() < 0.3:
                params["ignore_eos"] = True
            plans.append(Plan("good", prompt, params))
    return plans


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp("model_repository")
    (repository / "llm" / "1").mkdir(parents=True)
    bundled = Path(__file__).resolve().parents[1] / "model_repository" / "llm" / "config.pbtxt"
    (repository / "llm" / "config.pbtxt").write_text(bundled.read_text())
    (repository / "llm" / "1" / "model.json").write_text(json.dumps({
        "model": str(model_dir), "dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN,
        "num_kv_blocks": NUM_KV_BLOCKS, "max_num_seqs": CONCURRENCY}))
    log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    with TritonServer(repository, log_path=log) as running:
        yield running
        print(running.log_tail(3000))


def run(url: str, plan: Plan) -> Outcome:
    client = StreamClient(url)
    cancelled = False
    try:
        result = client.send("r", make_inputs(plan.prompt, plan.params, stream=True, return_num_output_tokens=True))
        if plan.kind == "cancel":
            deadline = time.monotonic() + 120
            while len(result.texts) < 2 and not result.done.is_set():
                assert time.monotonic() < deadline, "the stream to cancel never started"
                time.sleep(0.01)
            client.close(cancel=True)
            cancelled = True
        else:
            assert result.done.wait(180), f"no final response for {plan}"
    finally:
        if not cancelled:
            client.close()
    tokens = sum(int(arrays["num_output_tokens"].sum()) for arrays in result.arrays if "num_output_tokens" in arrays)
    return Outcome(plan, result.text(), tokens, result.error)


def test_soak_mixed_traffic_with_preemption(server: TritonServer, model_dir: Path) -> None:
    plans = make_plans()
    good = [plan for plan in plans if plan.kind == "good"]
    offline = LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    expected = offline.generate([p.prompt for p in good], [SamplingParams(**p.params) for p in good])
    want = {id(plan): output.outputs[0] for plan, output in zip(good, expected)}

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outcomes = list(pool.map(lambda plan: run(server.grpc_url, plan), plans))

    problems = []
    for outcome in outcomes:
        plan = outcome.plan
        if plan.kind == "good":
            reference = want[id(plan)]
            if outcome.error is not None or outcome.text != reference.text \
                    or outcome.num_tokens != len(reference.token_ids):
                problems.append(f"{plan}: got {outcome.text!r} ({outcome.num_tokens} tokens, error "
                                f"{outcome.error!r}), offline {reference.text!r} ({len(reference.token_ids)})")
        elif plan.kind == "bad" and outcome.error is None:
            problems.append(f"{plan}: succeeded, expected an error")
    assert not problems, "\n".join(problems[:10])
    counts = {kind: sum(plan.kind == kind for plan in plans) for kind in ("good", "bad", "cancel")}
    assert min(counts.values()) >= 20, counts

    # Settled, not the first reading with nothing running: gauges are published a little after their step, and
    # a reading from mid-soak (everything running just finished, one arrival not yet admitted) once passed a
    # "nothing running, no blocks" wait with a request still waiting.
    after = settled_metrics(server)
    assert after["pagedllm:kv_blocks_used"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["pagedllm:num_preemptions_total"] > 0, "the KV pool was meant to force preemption"

    check = Plan("good", "def main(self):", {"temperature": 0, "max_tokens": 8})
    answer = run(server.grpc_url, check)
    reference = offline.generate([check.prompt], SamplingParams(**check.params))[0].outputs[0]
    assert answer.error is None and answer.text == reference.text
    assert wait_for_metrics(server, lambda m: m.get("pagedllm:kv_blocks_used") == 0)["pagedllm:kv_blocks_used"] == 0
