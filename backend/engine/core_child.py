"""The engine core child: owns the ``LLMEngine`` and serves it over the pipe ``EngineCoreProcess`` opened."""
from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any

import torch

from pagedllm.core.errors import EngineBroken
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import latency_trace
from pagedllm.engine.core_process import CHILD_MARKER
from pagedllm.engine.core_wire import encode_outputs
from pagedllm.engine.engine_contract import STALLED_RETRY_S, progress
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.platform.cpu_binding import bind_engine
from pagedllm.platform.gc_tuning import freeze_startup_heap

log = logging.getLogger(__name__)


def child_main(fd: int) -> None:
    """Entry point of the child interpreter: serve the engine over the connection on ``fd``."""
    conn = Connection(fd)
    _, config, allowed_cpus = conn.recv()
    try:
        cpu_split = bind_engine(config.cpu_bind, allowed_cpus, CHILD_MARKER, torch.get_num_threads())
        if cpu_split is not None and cpu_split.explicit:
            torch.set_num_threads(len(cpu_split.engine))
        engine = LLMEngine(config)
    except Exception as error:
        conn.send(("failed", (type(error).__name__, str(error))))
        return
    freeze_startup_heap()
    info = {"max_model_len": engine.max_model_len, "tokenizer_dir": engine.tokenizer.name_or_path,
            "limits": engine.limits, "cpu_split": cpu_split}
    conn.send(("ready", info, engine.stats()))
    try:
        _serve(engine, conn)
    finally:
        engine.close()  # its tensor-parallel workers, if any, stop with it


def _serve(engine: Any, conn: Connection) -> None:
    stalled = False
    while True:
        # Block only when there is nothing to compute (or nothing could be scheduled last
        # time, which only a new command can change); otherwise take what has arrived and step.
        if not engine.has_unfinished_requests():
            conn.poll(None)
        elif stalled:
            conn.poll(STALLED_RETRY_S)
        while conn.poll(0):
            try:
                message = conn.recv()
            except EOFError:  # the parent is gone: nobody is left to serve
                return
            if message[0] == "stop":
                return
            if message[0] == "add":
                latency_trace.mark("core.admitted", message[1])
                error = _add(engine, message[1], message[2], message[3], message[4])
                if error is not None:
                    conn.send(("rejected", message[1], error))
            elif message[0] == "abort":
                engine.abort_request(message[1])
        if not engine.has_unfinished_requests():
            continue
        before = progress(engine.stats())
        try:
            outputs = engine.step()
        except EngineBroken as error:  # this engine is done: the parent's loop dies and the engine is replaced
            log.error("engine core cannot step again: %s", error)
            conn.send(("broken", str(error), engine.stats()))
            return
        except Exception as error:
            log.exception("engine step failed in the engine core process")
            conn.send(("step_failed", f"engine step failed: {error}", engine.stats()))
            continue
        if latency_trace.enabled():
            for output in outputs:
                latency_trace.mark("core.stepped", output.request_id)
        stats = engine.stats()
        stalled = not outputs and progress(stats) == before
        conn.send(("step", encode_outputs(outputs), stats))


def _add(engine: Any, request_id: str, prompt_ids: list[int], params: SamplingParams,
         lora_request: LoRARequest | None) -> str | None:
    """None, or why the engine refused a request the parent had already checked (it should not)."""
    try:
        engine.add_request(request_id, prompt_ids, params, lora_request)
    except Exception as error:
        log.exception("the engine core refused request %s after the parent admitted it", request_id)
        return f"engine refused the request: {type(error).__name__}: {error}"
    return None
