"""``pagedllm serve --health-port``: a liveness route that runs a real engine step, as vllm_backend's health check.

Triton's ``/v2/health/live`` only says the server process answers, and in 2.51 its
readiness stays true over a dead backend stub. ``GET /health`` here sends every
served model a one-token greedy ``generate`` through Triton's HTTP endpoint (so the
request crosses Triton, the stub, the engine loop and one model step) and answers
200 ``ok`` when each returned within ``timeout_s``, else 503 naming the model and
what went wrong. A probe that times out while the model's generated-token count grows
passes: the engine is busy, not dead. Probes run one at a time, so eager probers queue
here, not in the engine.

Where there is no launcher (a KServe pod runs tritonserver itself), the same check
runs as a command, for an ``exec`` liveness probe:
``python3 -m pagedllm.serving.health --http-url 127.0.0.1:8080`` exits 0 when every
ready model generated a token, 1 (printing why) otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROBE_BODY = json.dumps({"text_input": "a", "max_tokens": 1, "temperature": 0, "stream": False}).encode()


def probe_model(http_url: str, model: str, timeout_s: float, metrics_url: str | None = None) -> str | None:
    """None when ``model`` generated one token within ``timeout_s``, else what went wrong.

    A busy engine serves requests first come, first served, so the probe can wait behind a full
    queue. With ``metrics_url``, a probe that timed out still passes when the model's
    ``vllm:generation_tokens_total`` grew meanwhile: the engine is alive, only busy, and a
    liveness restart would drop every request in flight.
    """
    before = generated_tokens(metrics_url, model, timeout_s) if metrics_url else None
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
        if before is not None and _timed_out(error):
            after = generated_tokens(metrics_url, model, timeout_s)
            if after is not None and after > before:
                return None
        return f"model {model!r}: {error}"


def generated_tokens(metrics_url: str, model: str, timeout_s: float) -> float | None:
    """``model``'s ``vllm:generation_tokens_total`` from Triton's metrics endpoint; None if unreadable."""
    try:
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=timeout_s) as answer:
            lines = answer.read().decode(errors="replace").splitlines()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    label = f'model="{model}"'
    values = [float(line.rsplit(" ", 1)[1]) for line in lines
              if line.startswith("vllm:generation_tokens_total{") and label in line]
    return sum(values) if values else None


def _timed_out(error: Exception) -> bool:
    return isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)


class HealthServer:
    """Serves ``GET /health`` on ``host:port`` from a daemon thread; ``http_url`` and ``models`` are read per probe."""

    def __init__(self, host: str, port: int, http_url: Callable[[], str], models: Callable[[], Sequence[str]], *,
                 metrics_url: Callable[[], str | None] = lambda: None, timeout_s: float = 10.0) -> None:
        self._http_url = http_url
        self._metrics_url = metrics_url
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
            return first_problem(self._http_url(), models, self._timeout_s, self._metrics_url())

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def first_problem(http_url: str, models: Sequence[str], timeout_s: float, metrics_url: str | None) -> str | None:
    """The first model's problem (see :func:`probe_model`), or None when every model is alive."""
    return next((p for p in (probe_model(http_url, model, timeout_s, metrics_url) for model in models) if p), None)


def ready_models(http_url: str, timeout_s: float) -> list[str]:
    """The models Triton's repository index lists as READY."""
    request = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return [entry["name"] for entry in json.loads(answer.read()) if entry.get("state") == "READY"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Liveness check that runs a real engine step through Triton")
    parser.add_argument("--http-url", default="127.0.0.1:8000", help="Triton's HTTP endpoint, host:port")
    parser.add_argument("--model", action="append", default=None,
                        help="model to probe (repeatable; default: every model Triton lists as READY)")
    parser.add_argument("--metrics-url", default="127.0.0.1:8002",
                        help="Triton's metrics endpoint, host:port: a probe that times out while the model's "
                             "generated-token count grows passes (busy, not dead); '' turns that off")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per model")
    args = parser.parse_args(argv)
    try:
        models = args.model or ready_models(args.http_url, args.timeout)
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as error:
        print(f"unhealthy: cannot list models at {args.http_url}: {error}", file=sys.stderr)
        return 1
    if not models:
        print("unhealthy: no model is being served", file=sys.stderr)
        return 1
    problem = first_problem(args.http_url, models, args.timeout, args.metrics_url or None)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
