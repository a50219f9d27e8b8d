"""``pagedllm serve --speculative-config`` end to end: tritonclient gRPC streaming and the OpenAI endpoint return
the offline greedy tokens without speculation, and the four ``vllm:spec_decode_*`` series add up.

The embedded default model (trained on Python sources) copies code it has seen, so its drafts get accepted.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import requests
from installed import need

need("tritonclient.grpc")
openai = need("openai")

from serve_process import follow, kill, wait_ready  # noqa: E402
from test_triton_server import greedy, stream_once  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.core.model_source import DEFAULT_MODEL_DIR  # noqa: E402
from pagedllm.platform.processes import free_port  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["def area(width, height):\n    return width * height\n\n\ndef area(",
           "import os\nimport sys\n\nfor name in sys.argv:\n    print(os.path.basename(name))\nfor name in "]
MAX_TOKENS = 32


@dataclass
class Serve:
    process: subprocess.Popen[str]
    grpc_url: str
    openai_url: str
    metrics_url: str
    output: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    grpc, http, metrics, port = free_port(), free_port(), free_port(), free_port()
    scratch = tmp_path_factory.mktemp("serve-tmp")
    env = {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(DEFAULT_MODEL_DIR),
               "--served-model-name", "default", "--speculative-config", json.dumps(SPEC),
               "--engine-arg", "device=cpu", "--engine-arg", "dtype=float32", "--host", "127.0.0.1", "--grpc-port", str(grpc), "--http-port", str(http),
               "--metrics-port", str(metrics), "--openai-port", str(port)]
    # From a neutral folder: nothing in the repository root shadows an installed package.
    process = subprocess.Popen(command, env=env, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    running = Serve(process, f"127.0.0.1:{grpc}", f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{metrics}/metrics")
    follow(process, running.output)
    try:
        wait_ready(process, running.output)
        yield running
    finally:
        kill(process)


def settled_metrics(url: str, timeout_s: float = 30.0) -> str:
    """The spec-decode lines of /metrics once two reads 0.5 s apart agree: the publisher trails the engine's
    last step a little."""
    def read() -> str:
        return "\n".join(line for line in requests.get(url, timeout=10).text.splitlines()
                         if line.startswith("vllm:spec_decode_"))

    deadline = time.monotonic() + timeout_s
    previous = read()
    while True:
        time.sleep(0.5)
        current = read()
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current


@pytest.fixture(scope="module")
def offline() -> list[str]:
    """The greedy texts without speculation."""
    outs = LLM(device="cpu", dtype="float32").generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [out.outputs[0].text for out in outs]


def test_grpc_and_openai_stream_the_offline_greedy_text_and_the_counters_add_up(serve: Serve,
                                                                                offline: list[str]) -> None:
    for prompt, expected in zip(PROMPTS, offline):
        result = stream_once(serve.grpc_url, prompt, greedy(MAX_TOKENS), stream=True)
        assert result.error is None and result.text() == expected
    client = openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=120)
    for prompt, expected in zip(PROMPTS, offline):
        chunks = client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected

    text = settled_metrics(serve.metrics_url)

    def series(name: str) -> list[tuple[str, float]]:
        return [(labels, float(value)) for labels, value in
                re.findall(rf"^vllm:spec_decode_{name}\{{([^}}]*)\}} (\S+)$", text, re.M)]

    [(_, drafts)], [(_, draft_tokens)], [(_, accepted)] = (
        series("num_drafts"), series("num_draft_tokens"), series("num_accepted_tokens"))
    per_position = series("num_accepted_tokens_per_pos")
    assert 0 < accepted <= draft_tokens <= SPEC["num_speculative_tokens"] * drafts
    assert sorted(re.search(r'position="(\d+)"', labels).group(1) for labels, _ in per_position) == ["0", "1", "2"]
    assert sum(value for _, value in per_position) == accepted
