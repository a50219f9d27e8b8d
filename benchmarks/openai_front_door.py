"""The OpenAI front door for ``pagedllm bench serving --api openai``: a child process beside tritonserver.

It runs the same app ``pagedllm serve --openai-port`` runs, in its own process as there
(so the load client's threads do not share its interpreter lock). The benchmark model
has no chat template, so this one gets a pass-through template: a chat request with one
user message sends Triton the prompt the gRPC path sends, behind one newline. So both
paths serve the same requests, but the chat run cannot reuse the KV blocks that the
gRPC run of the same prompts left in the prefix cache (block hashes chain from the
first token).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import time
from pathlib import Path
from types import TracebackType

import requests

from pagedllm.platform.processes import free_port

PASSTHROUGH_CHAT_TEMPLATE = "\n{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _serve(grpc_url: str, model_name: str, model_dir: str, port: int) -> None:
    import uvicorn

    from pagedllm.serving.openai.app import build_app
    from pagedllm.serving.openai.served_models import ServedModel

    loaded = ServedModel.load(model_name, model_name, Path(model_dir))
    model = dataclasses.replace(loaded, tokenizer=dataclasses.replace(loaded.tokenizer,
                                                                      chat_template=PASSTHROUGH_CHAT_TEMPLATE))
    uvicorn.run(build_app(grpc_url, [model]), host="127.0.0.1", port=port, log_level="warning", access_log=False)


class OpenAIFrontDoor:
    """``with OpenAIFrontDoor(grpc_url, "llm", model_dir) as door:`` serves ``door.base_url`` until the block ends."""

    def __init__(self, grpc_url: str, model_name: str, model_dir: Path, startup_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._process = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(grpc_url, model_name, str(model_dir), self.port), daemon=True)
        self._startup_timeout_s = startup_timeout_s
        self._model_name = model_name

    def __enter__(self) -> OpenAIFrontDoor:
        self._process.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._healthy():
            if not self._process.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the OpenAI front door did not come up (see its log above)")
            time.sleep(0.2)
        self._warm_up()
        return self

    def _warm_up(self) -> None:
        """One short chat request, so the measured runs do not pay for first-use set-up (the gRPC
        channel, the template's compilation, the engine's first step); it runs before any load."""
        body = {"model": self._model_name, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}
        response = requests.post(f"{self.base_url}/chat/completions", json=body, timeout=120)
        if response.status_code != 200:
            self.close()
            raise RuntimeError(f"the OpenAI front door failed its warm-up request: {response.text[:300]}")

    def _healthy(self) -> bool:
        try:
            return requests.get(self.base_url.removesuffix("/v1") + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def close(self) -> None:
        if self._process.is_alive():
            self._process.terminate()  # uvicorn finishes open responses on SIGTERM
            self._process.join(15)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
