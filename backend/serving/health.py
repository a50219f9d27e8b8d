"""``pagedllm serve --health-port``: a liveness route that runs a real engine step, as vllm_backend's health check.

Triton's ``/v2/health/live`` only says the server process answers, and in 2.51 its
readiness stays true over a dead backend stub. ``GET /health`` here sends every
served model a one-token greedy ``generate`` through Triton's HTTP endpoint (so the
request crosses Triton, the stub, the engine loop and one model step) and answers
200 ``ok`` when each returned within ``timeout_s``, else 503 naming the model and
what went wrong. Probes run one at a time, so eager probers queue here, not in the engine.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROBE_BODY = json.dumps({"text_input": "a", "max_tokens": 1, "temperature": 0, "stream": False}).encode()


def probe_model(http_url: str, model: str, timeout_s: float) -> str | None:
    """None when ``model`` generated one token within ``timeout_s``, else what went wrong."""
    request = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate", data=PROBE_BODY,
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            if "text_output" not in json.loads(answer.read()):
                return f"model {model!r}: no text_output in the answer"
            return None
    except urllib.error.HTTPError as error:
        return f"model {model!r}: HTTP {error.code}: {error.read().decode(errors='replace')[:300]}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as error:
        return f"model {model!r}: {error}"


class HealthServer:
    """Serves ``GET /health`` on ``host:port`` from a daemon thread; ``http_url`` and ``models`` are read per probe."""

    def __init__(self, host: str, port: int, http_url: Callable[[], str], models: Callable[[], Sequence[str]], *,
                 timeout_s: float = 10.0) -> None:
        self._http_url = http_url
        self._models = models
        self._timeout_s = timeout_s
        self._probing = threading.Lock()
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?")[0] != "/health":
                    self.send_error(404)
                    return
                problem = health.check()
                body = (problem or "ok").encode()
                self.send_response(503 if problem else 200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                """Probes every few seconds would flood the console."""

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="pagedllm-health", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def check(self) -> str | None:
        """None when every model ran a step, else the first problem."""
        with self._probing:
            models = list(self._models())
            if not models:
                return "no model is being served"
            return next((problem for problem in (probe_model(self._http_url(), model, self._timeout_s)
                                                 for model in models) if problem), None)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
