"""The engine core in a child process, behind the interface ``EngineLoop`` drives.

In the Triton stub the engine loop, response building, the sender and
Triton's own threads would otherwise share one GIL. Here the child owns the
``LLMEngine`` and steps it whenever it has work, sending each step's outputs
(text deltas already detokenized) and stats through a pipe; the parent's
``EngineCoreProcess`` forwards ``add_request`` / ``abort_request`` and hands
the outputs to the loop one step at a time, sleeping in ``recv`` (GIL released)
in between; the loop interrupts that sleep when it has a request to pass on
(``interrupt``), which the child reads before its next step.

The parent admits requests itself (tokenizing and checking them against the engine's
``AdmissionLimits``, the same code ``LLMEngine.add_request`` runs) and sends the token
ids without waiting for an answer: the child reads its messages only between steps, so
waiting for a verdict admitted one request per step and left a burst of arrivals
queued for as many steps. The prompt never travels back: the parent puts it on the
outputs. If the child dies (a crashing kernel, the OOM killer), the step
that notices raises, the loop fails the in-flight requests, and the next call
starts a fresh child: the server keeps serving without a reload. The child
(``core_child``) binds itself to CPUs of its own as ``cpu_bind`` says
(:mod:`pagedllm.platform.cpu_binding`), and the stub moves its threads to the rest.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.core.config import EngineConfig
from pagedllm.engine import latency_trace
from pagedllm.engine.admission import AdmissionLimits, check_request, tokenize_prompt
from pagedllm.platform.cpu_binding import CpuSplit, pin_process
from pagedllm.engine.core_wire import decode_outputs
from pagedllm.core.errors import EngineBroken
from pagedllm.engine.outputs import RequestOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # loading a large checkpoint takes minutes
CHILD_MARKER = "from pagedllm.engine.core_child import child_main"  # in every engine child's command line


class EngineCoreDied(RuntimeError):
    """The child process ended; the message has its exit code."""


class EngineCoreProcess:
    """An ``LLMEngine`` in its own process (see the module docstring); not thread-safe, like the engine."""

    def __init__(self, config: EngineConfig, bind_caller: bool = False,
                 allowed_cpus: frozenset[int] | None = None) -> None:
        """``bind_caller``: also restrict this (the calling) process to the CPUs ``config.cpu_bind`` leaves
        to the serving side; the Triton stub does, a library caller should not have its process pinned.
        ``allowed_cpus``: the CPUs to split (default: this process's affinity now)."""
        self.config = config
        self.restarts = 0
        # The loop's doorbell (engine_contract.Interruptible): step() waits on the child and on this.
        self._doorbell, self._ring = socket.socketpair()
        self._doorbell.setblocking(False)
        self._ring.setblocking(False)
        # Captured before anything is pinned, so a restarted child splits the same CPUs.
        self._allowed_cpus = allowed_cpus if allowed_cpus is not None else frozenset(os.sched_getaffinity(0))
        self._start()
        self.cpu_split: CpuSplit | None = self._info["cpu_split"]
        if bind_caller and self.cpu_split is not None and self.cpu_split.serving:
            pin_process(self.cpu_split.serving)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(self._info["tokenizer_dir"])
        self.max_model_len: int = self._info["max_model_len"]

    # ---- EngineLike ----

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; raises ``ValueError`` for input it could never serve, as ``LLMEngine`` does (an
        adapter's own faults are found in the child, which ends the request with an error)."""
        self._ensure_alive()
        if request_id in self._in_flight:
            raise ValueError(f"request_id={request_id!r} is already in flight")
        limits: AdmissionLimits = self._info["limits"]
        prompt_ids, text = tokenize_prompt(self.tokenizer, prompt, limits.vocab_size)
        check_request(prompt_ids, params, limits)
        if lora_request is not None and not self.config.enable_lora:
            raise ValueError(f"lora_request={lora_request.lora_name!r} needs an engine with enable_lora=true")
        self._send(("add", request_id, prompt_ids, params, lora_request))
        latency_trace.mark("stub.submitted", request_id)
        self._in_flight.add(request_id)
        self._prompts[request_id] = (text, tuple(prompt_ids))

    def abort_request(self, request_id: str) -> None:
        if request_id in self._in_flight and self._process.poll() is None:
            self._send(("abort", request_id))

    def step(self) -> list[RequestOutput]:
        """The child's next step's outputs; ``[]`` at once if interrupted while none has arrived."""
        self._ensure_alive()
        while not self._steps:
            if self._conn not in wait([self._conn, self._doorbell]):
                return []
            self._keep(self._recv())
        outcome = self._steps.popleft()
        if isinstance(outcome, EngineBroken):
            raise outcome
        if isinstance(outcome, str):
            raise RuntimeError(outcome)
        for output in outcome:
            if output.finished:
                self._in_flight.discard(output.request_id)
                self._prompts.pop(output.request_id, None)
        return outcome

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight)

    def stats(self) -> Any:
        return self._stats

    def interrupt(self) -> None:
        try:
            self._ring.send(b"\0")
        except OSError:  # full (step() returns anyway) or closed (nothing left to interrupt)
            pass

    def clear_interrupt(self) -> None:
        try:
            while self._doorbell.recv(4096):
                pass
        except OSError:  # drained (BlockingIOError) or closed
            pass

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child, killing it if it does not stop within ``timeout_s``."""
        if self._process.poll() is None:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout_s)
        self._conn.close()
        self._doorbell.close()
        self._ring.close()

    # ---- parent side ----

    def _start(self) -> None:
        # A plain child interpreter rather than multiprocessing's spawn, which would re-run the
        # parent's main module (inside Triton's stub there is no such module to re-run).
        parent_end, child_end = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        command = [_python_executable(), "-c", f"{CHILD_MARKER}; child_main({child_end.fileno()})"]
        self._process = subprocess.Popen(command, pass_fds=[child_end.fileno()], env=env)
        child_end.close()
        self._conn = Connection(parent_end.detach())
        self._in_flight: set[str] = set()
        self._prompts: dict[str, tuple[str | None, tuple[int, ...]]] = {}  # of the requests in flight
        self._steps: deque[list[RequestOutput] | str | EngineBroken] = deque()
        self._send(("config", self.config, self._allowed_cpus))
        if not self._conn.poll(START_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:.0f} s")
        message = self._recv()
        if message[0] == "failed":
            self._process.wait(10)
            kind, text = message[1]
            raise ValueError(text) if kind == "ValueError" else RuntimeError(text)
        self._info: dict[str, Any] = message[1]
        self._stats = message[2]

    def _ensure_alive(self) -> None:
        code = self._process.poll()
        if code is None:
            return
        self._conn.close()
        self.restarts += 1
        log.error("engine core process died (exit code %s); starting a new one (restart %d)", code, self.restarts)
        self._start()

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._conn.send(message)
        except OSError as error:
            raise EngineCoreDied(f"engine core process is gone: {error}") from error

    def _recv(self) -> tuple[Any, ...]:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as error:
            try:
                code = self._process.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            self._in_flight.clear()
            self._prompts.clear()
            self._steps.clear()
            raise EngineCoreDied(f"engine core process died (exit code {code}); "
                                 "in-flight requests are lost, the next request starts a new engine") from error

    def _keep(self, message: tuple[Any, ...]) -> None:
        if message[0] == "rejected":  # admitted here, refused there: ends like a request the engine failed
            _, request_id, error = message
            self._steps.append(decode_outputs([(request_id, (), True, error, None, False)], self._prompts))
        elif message[0] == "step":
            self._steps.append(decode_outputs(message[1], self._prompts))
            self._stats = message[2]
        elif message[0] == "step_failed":
            self._steps.append(message[1])
            self._stats = message[2]
        elif message[0] == "broken":
            self._steps.append(EngineBroken(message[1]))
            self._stats = message[2]


def _python_executable() -> str:
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    found = shutil.which("python3") or shutil.which("python")
    if found is None:
        raise RuntimeError("no python interpreter found on PATH for the engine core process")
    return found
