"""The routes routers probe on a replica (pagedllm.serving.openai.router_routes), without a Triton server."""
from __future__ import annotations

import dataclasses

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from installed import need

need("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from pagedllm.serving.openai.app import build_app  # noqa: E402
from pagedllm.serving.openai.router_routes import engine_load  # noqa: E402
from pagedllm.serving.openai.served_models import ServedModel  # noqa: E402

# What Triton's metrics endpoint shows for two models, one of them not served by this door.
METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model="llm",version="1"} 3
vllm:num_requests_running{model="other",version="1"} 7
vllm:num_requests_waiting{model="llm",version="1"} 2
pagedllm:kv_blocks_used{model="llm",version="1"} 5
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",model="llm",num_gpu_blocks="64",version="1"} 1
nv_inference_count{model="llm",version="1"} 9
"""


@pytest.fixture(scope="module")
def metrics_endpoint() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            body = METRICS.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> ServedModel:
    served = ServedModel.load("tiny", "llm", tiny_model_dir("llama"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    return dataclasses.replace(served, tokenizer=dataclasses.replace(served.tokenizer, chat_template=template))


@pytest.fixture(scope="module")
def http(model: ServedModel, metrics_endpoint: str) -> Iterator[TestClient]:
    with TestClient(build_app("127.0.0.1:1", [model], metrics_url=metrics_endpoint)) as client:
        yield client


def test_engine_load_reads_only_the_served_models_gauges() -> None:
    load = engine_load(METRICS, {"llm"})
    assert (load.running, load.waiting, load.kv_tokens, load.block_size) == (3, 2, 5 * 16, 16)
    assert engine_load(METRICS, {"absent"}).running == 0


def test_load_probes_answer_in_the_routers_shapes(http: TestClient) -> None:
    assert http.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 80}]
    assert http.get("/load").json() == {"server_load": 5}
    assert http.get("/get_server_info").json()["kv_block_size"] == 16
    assert http.get("/get_model_info").json()["model_path"] == "tiny"
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.text == METRICS


def test_without_a_metrics_endpoint_the_load_probes_are_503(model: ServedModel) -> None:
    with TestClient(build_app("127.0.0.1:1", [model])) as client:
        assert client.get("/get_load").status_code == 503
        assert client.get("/get_model_info").status_code == 200


def test_render_gives_the_token_ids_the_engine_will_see(http: TestClient, model: ServedModel) -> None:
    prompt = "The quick brown fox"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "no_stop_trim": False}  # a router's extra field
    (rendered,) = http.post("/v1/completions/render", json=body).json()
    assert rendered["token_ids"] == model.tokenizer.encode(prompt) and rendered["model"] == "tiny"
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/v1/chat/completions/render", json={"model": "tiny", "messages": messages}).json()
    assert chat["token_ids"] == model.tokenizer.encode(model.chat_prompt(messages))
    assert http.post("/v1/completions/render", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert http.post("/v1/completions/render", json={"model": "tiny", "prompt": ""}).status_code == 400
