"""Run the OpenAI-compatible app with uvicorn on a background thread of the ``pagedllm serve`` process.

A thread (not a child process) so that the launcher's existing Ctrl-C / SIGTERM
handling stops both servers: uvicorn installs no signal handlers off the main thread,
and ``stop()`` asks it to finish its open responses and exit.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import TracebackType

import uvicorn

from pagedllm.serving.openai.app import build_app
from pagedllm.serving.openai.lora_adapters import LoRABase
from pagedllm.serving.openai.served_models import ServedModel


class OpenAIServer:
    """``start()`` returns once the port accepts connections; ``stop()`` is idempotent."""

    def __init__(self, grpc_url: str, models: Sequence[ServedModel], *, host: str = "127.0.0.1", port: int = 9000,
                 startup_timeout_s: float = 60.0, tool_call_parser: str | None = None,
                 runtime_lora: LoRABase | None = None, metrics_url: str | None = None) -> None:
        self.host = host
        self.port = port
        config = uvicorn.Config(build_app(grpc_url, models, tool_call_parser, runtime_lora, metrics_url), host=host, port=port,
                                log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="openai-http", daemon=True)
        self._startup_timeout_s = startup_timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> OpenAIServer:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the OpenAI server could not start on {self.host}:{self.port} (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the OpenAI server did not start within {self._startup_timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
