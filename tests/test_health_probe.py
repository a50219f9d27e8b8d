"""The liveness probe tells a busy engine (its probe queued, tokens still flowing) from a dead one."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedllm.serving.health import probe_model

pytestmark = pytest.mark.server  # a stand-in Triton HTTP server on a local port


class FakeTriton:
    """Answers generate after ``delay_s`` and serves a generated-token counter that grows by ``rate`` per read."""

    def __init__(self, delay_s: float, rate: int) -> None:
        self.tokens = 100
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                time.sleep(delay_s)
                self._answer(b'{"text_output": "a"}')

            def do_GET(self) -> None:  # noqa: N802
                fake.tokens += rate
                self._answer(f'vllm:generation_tokens_total{{model="llm",version="1"}} {fake.tokens}\n'
                             f'vllm:generation_tokens_total{{model="other",version="1"}} 7\n'.encode())

            def _answer(self, body: bytes) -> None:
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the probe gave up waiting
                    pass

            def log_message(self, format: str, *args: object) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def fake() -> Iterator[Callable[[float, int], FakeTriton]]:
    servers: list[FakeTriton] = []

    def make(delay_s: float, rate: int) -> FakeTriton:
        servers.append(FakeTriton(delay_s, rate))
        return servers[-1]

    yield make
    for server in servers:
        server.server.shutdown()
        server.server.server_close()


def test_a_probe_that_answers_in_time_passes(fake: Callable[[float, int], FakeTriton]) -> None:
    server = fake(0.0, 0)
    assert probe_model(server.url, "llm", 2.0, metrics_url=server.url) is None


def test_a_queued_probe_passes_while_the_model_generates(fake: Callable[[float, int], FakeTriton]) -> None:
    server = fake(1.0, 5)
    assert probe_model(server.url, "llm", 0.3, metrics_url=server.url) is None


def test_a_queued_probe_fails_when_no_token_was_generated(fake: Callable[[float, int], FakeTriton]) -> None:
    server = fake(1.0, 0)
    problem = probe_model(server.url, "llm", 0.3, metrics_url=server.url)
    assert problem is not None and "model 'llm'" in problem and "timed out" in problem


def test_without_metrics_a_queued_probe_fails(fake: Callable[[float, int], FakeTriton]) -> None:
    server = fake(1.0, 5)
    assert probe_model(server.url, "llm", 0.3) is not None
