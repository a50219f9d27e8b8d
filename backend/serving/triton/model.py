"""Triton Python-based backend ``pagedllm``: decoupled, vllm_backend-compatible, Triton I/O only.

``execute`` parses each request (``serving.request_codec``), hands it to the
``EngineLoop`` and returns at once. The loop thread turns each engine step into
tensors (``serving.response_codec``) and a single sender thread sends them through
the request's response sender in order, the last one with the FINAL flag (merging a
request's backlog when sending falls behind, see ``serving.response_dispatcher``). Each
in-flight request's cancellation flag is checked before every engine step (a watcher
thread refreshes the flags from ``is_cancelled()``, off the engine thread); a
cancelled request is aborted (its KV blocks go back to the pool at that step) and
ends with a CANCELLED error. Bad input ends with an INVALID_ARG error naming the
field; a request the engine faulted on alone, or a failed step, ends with INTERNAL.
Every request gets exactly one FINAL response, whatever happens (see ``_Stream.end``).

Health, as vllm_backend's ``ENABLE_VLLM_HEALTH_CHECK``: if the engine loop dies, new
requests get UNAVAILABLE with the reason, and the model asks Triton to unload it
(``pb_utils.unload_model``), which turns ``/v2/models/<name>/ready`` false. Triton
allows that only with ``--model-control-mode=explicit``, which ``pagedllm serve``
uses; under other modes the model stays listed as ready and answers UNAVAILABLE.
Under ``pagedllm serve`` (``serving.supervision``) the model also records why its
engine died, so the launcher reloads it, tells its in-flight streams that the engine
is restarting, and publishes the launcher's restart count as
``pagedllm:engine_restarts_total``.
Metrics (``serving.metrics``): vllm_backend's ``vllm:*`` series plus ours, unless
config.pbtxt sets ``REPORT_CUSTOM_METRICS`` to ``"false"``.
``finalize`` returns within ``FINALIZE_BUDGET_S`` whatever the engine is doing: each
in-flight stream gets a final UNAVAILABLE error.

This is the only module that imports ``triton_python_backend_utils``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedllm.engine import latency_trace
from pagedllm.engine.core_process import EngineCoreProcess
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.core.model_source import DEFAULT_MODEL_DIR
from pagedllm.core.errors import EngineUnavailable, FailureKind
from pagedllm.engine.engine_loop import EngineLoop
from pagedllm.platform.gc_tuning import freeze_startup_heap
from pagedllm.engine.outputs import RequestOutput
from pagedllm.lora.modules import LoRAModules, served_modules
from pagedllm.core.model_source import resolve_model_dir
from pagedllm.serving.triton.cancellation import CancellationWatcher
from pagedllm.serving.engine_args import load_engine_config
from pagedllm.serving.triton.metrics import TritonMetrics, custom_metrics_enabled
from pagedllm.serving.triton.request_codec import (
    INPUT_NAMES,
    INPUT_SPECS,
    MAX_PROMPT_BYTES_PER_TOKEN,
    OUTPUT_SPECS,
    parse_request,
)
from pagedllm.serving.triton.response_codec import ResponseAssembler, Tensors
from pagedllm.serving.triton.response_dispatcher import Data, Failure, ResponseDispatcher
from pagedllm.serving.server_placement import TritonServerThreads
from pagedllm.serving.triton import stop_signal
from pagedllm.serving.supervisor_folder import SupervisorFolder


FINALIZE_BUDGET_S = 10.0
_ERROR_CODES = {FailureKind.REQUEST: "INTERNAL", FailureKind.INVALID: "INVALID_ARG", FailureKind.ENGINE: "INTERNAL",
                FailureKind.UNAVAILABLE: "UNAVAILABLE", FailureKind.TIMEOUT: "UNAVAILABLE"}


@dataclass(slots=True)
class _Stream:
    """One in-flight Triton request."""

    request_id: str
    sender: Any  # pb_utils.InferenceResponseSender
    assembler: ResponseAssembler
    ended: bool = False
    answered: bool = False  # a response was queued: the next one is not the first
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def end(self) -> bool:
        """Claim the right to queue this stream's FINAL response; True for exactly one caller."""
        with self.lock:
            first, self.ended = not self.ended, True
            return first


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, config: Any) -> Any:
        declared = config.as_dict()
        inputs = {spec["name"] for spec in declared.get("input", [])}
        outputs = {spec["name"] for spec in declared.get("output", [])}
        for spec in INPUT_SPECS:
            if spec["name"] not in inputs:
                config.add_input(dict(spec))
        for spec in OUTPUT_SPECS:
            if spec["name"] not in outputs:
                config.add_output(dict(spec))
        config.set_model_transaction_policy({"decoupled": True})
        config.set_max_batch_size(0)
        return config

    def initialize(self, args: dict[str, str]) -> None:
        self._logger = pb_utils.Logger
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ValueError("model_transaction_policy.decoupled must be true for the pagedllm backend")
        report_metrics = custom_metrics_enabled(model_config)  # a bad value fails the load before the engine starts
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        engine_config = load_engine_config(version_dir)
        if args.get("model_instance_kind") == "GPU" and engine_config.device == "auto":
            # KIND_GPU instances are placed by Triton: use the GPU it assigned to this instance.
            engine_config = dataclasses.replace(engine_config, device=f"cuda:{args['model_instance_device_id']}")
        # Adapters named in multi_lora.json, each checked before the engine starts: a bad entry fails the load.
        self._lora: LoRAModules | None = None
        if engine_config.enable_lora:
            model_dir = (resolve_model_dir(engine_config.model, engine_config.revision) if engine_config.model
                         else DEFAULT_MODEL_DIR)
            self._lora = served_modules(version_dir, model_dir, engine_config.max_lora_rank)
        self._logger.log_info(f"[pagedllm] starting engine with {engine_config}")
        self._model_name = args["model_name"]
        # The stub's threads and tritonserver's move off the CPUs the engine child binds (engine.cpu_binding,
        # serving.server_placement); tritonserver's only at the end, as nothing gives them back if this fails.
        server = TritonServerThreads.parent() if engine_config.engine_process else None
        self._engine = (EngineCoreProcess(engine_config, bind_caller=True,
                                          allowed_cpus=server.cpus if server is not None else None)
                        if engine_config.engine_process else LLMEngine(engine_config))
        self._supervision = SupervisorFolder.from_environment()
        if self._supervision is not None:
            self._engine.step = self._supervision.with_fault_hook(self._model_name, self._engine.step)
        self._max_prompt_bytes = self._engine.max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
        speculative = engine_config.speculative_config
        self._metrics = (self._create_metrics({"model": args["model_name"], "version": args["model_version"]},
                                              0 if speculative is None else speculative.num_speculative_tokens)
                         if report_metrics else None)
        if self._metrics is not None and self._supervision is not None:
            self._metrics.count_restarts(self._supervision.restarts(self._model_name))
        self._dispatcher = ResponseDispatcher(self._send, self._send_error_now)
        self._watcher = CancellationWatcher()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        on_step = self._metrics.record if self._metrics is not None else None
        self._loop = EngineLoop(self._engine, on_step=on_step, on_death=self._on_engine_death).start()
        if not stop_signal.watch(self._stop_serving):
            self._logger.log_warn("[pagedllm] not on a backend stub's main thread: SIGTERM will not end requests early")
        split = self._engine.cpu_split if isinstance(self._engine, EngineCoreProcess) else None
        self._server_threads: TritonServerThreads | None = None
        if server is not None and split is not None and split.serving:
            server.confine(split.serving)
            self._server_threads = server
        freeze_startup_heap()  # a stub process serves this one model instance for its whole life
        self._logger.log_info(f"[pagedllm] ready: max_model_len={self._engine.max_model_len}, "
                              f"{self._engine.stats().num_blocks_total} KV blocks of {engine_config.block_size}")

    def _create_metrics(self, labels: dict[str, str], speculative_positions: int) -> TritonMetrics | None:
        # MetricFamily only exists once the stub serves a model (not during auto-complete).
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}

        def make_family(name: str, description: str, kind: str) -> Any:
            return pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])

        try:
            return TritonMetrics(make_family, labels, self._engine.max_model_len, speculative_positions)
        except pb_utils.TritonModelException as error:
            # Raised when the server runs with --allow-metrics=false.
            self._logger.log_warn(f"[pagedllm] custom metrics unavailable: {error}")
            return None

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._start(request, sender)
            except Exception as error:  # never leave a client without its FINAL response
                self._logger.log_error(f"[pagedllm] failed to start a request: {error!r}")
                self._push(uuid.uuid4().hex, sender, Failure(f"internal error: {error}", "INTERNAL"))
        return None

    def _start(self, request: Any, sender: Any) -> None:
        latency_trace.mark("stub.received", request.request_id() or "")
        unavailable = self._loop.error
        if unavailable is not None:
            self._push(uuid.uuid4().hex, sender, Failure(f"model unavailable: {unavailable}", "UNAVAILABLE"))
            return
        try:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            parsed = parse_request(inputs, request.parameters(), max_prompt_bytes=self._max_prompt_bytes)
            lora_request = None
            if parsed.lora_name is not None:
                if self._lora is None:
                    raise ValueError("lora_name: this model serves no adapters (enable_lora is false in model.json)")
                lora_request = self._lora.request(parsed.lora_name)
        except ValueError as error:
            self._push(uuid.uuid4().hex, sender, Failure(f"invalid request: {error}", "INVALID_ARG"))
            return
        request_id = f"{request.request_id() or 'triton'}-{uuid.uuid4().hex}"
        stream = _Stream(request_id, sender, ResponseAssembler(parsed, self._decode_token))
        with self._streams_lock:
            self._streams[request_id] = stream
        is_cancelled = self._watcher.register(request_id, sender.is_cancelled)
        try:
            verdict = self._loop.submit_nowait(
                request_id, parsed.prompt, parsed.params,
                on_output=lambda output: self._on_output(stream, output),
                on_error=lambda message, kind: self._on_request_error(stream, message, kind),
                is_cancelled=is_cancelled, lora_request=lora_request,
            )
        except EngineUnavailable as error:
            self._end_with_error(stream, f"model unavailable: {error}", "UNAVAILABLE")
            return
        verdict.add_done_callback(lambda done: self._on_verdict(stream, done))

    def _on_verdict(self, stream: _Stream, verdict: Future[None]) -> None:
        error = verdict.exception()
        if isinstance(error, ValueError):
            self._end_with_error(stream, f"invalid request: {error}", "INVALID_ARG")
        elif isinstance(error, EngineUnavailable):
            self._end_with_error(stream, f"model unavailable: {error}", "UNAVAILABLE")
        elif error is not None:
            self._end_with_error(stream, f"internal error: {error}", "INTERNAL")

    def _on_request_error(self, stream: _Stream, message: str, kind: FailureKind) -> None:
        if self._loop.death is not None and self._supervision is not None:
            message = f"{message}; the engine is restarting"
        if kind is FailureKind.INVALID:
            message = f"invalid request: {message}"
        self._end_with_error(stream, message, _ERROR_CODES[kind])

    def _end_with_error(self, stream: _Stream, message: str, code: str) -> None:
        if self._claim_end(stream):
            self._push(stream.request_id, stream.sender, Failure(message, code))

    def _claim_end(self, stream: _Stream) -> bool:
        """Stop tracking ``stream``; True if the caller is the one to queue its FINAL response."""
        if not stream.end():
            return False
        self._watcher.unregister(stream.request_id)
        with self._streams_lock:
            self._streams.pop(stream.request_id, None)
        return True

    def _on_engine_death(self, reason: str) -> None:
        """Loop thread, dying: make Triton stop routing here, as vllm_backend's health check does."""
        self._logger.log_error(f"[pagedllm] {reason}; unloading model {self._model_name!r}")
        try:
            pb_utils.unload_model(self._model_name)  # returns at once; Triton unloads us later
        except Exception as error:  # only allowed with --model-control-mode=explicit
            self._logger.log_warn(f"[pagedllm] could not unload the model ({error}): it stays listed as ready "
                                  "and answers UNAVAILABLE")
        # Only now: the launcher reloads a model that recorded its death, and that load must reach Triton
        # after this unload, or the unload would remove the fresh instance.
        if self._supervision is not None:
            try:
                self._supervision.record_death(self._model_name, reason)
            except OSError as error:
                self._logger.log_error(f"[pagedllm] could not tell pagedllm serve to reload the model: {error}")

    def _push(self, key: str, sender: Any, item: Data | Failure, inline: bool = False, first: bool = False) -> None:
        try:
            self._dispatcher.push(key, sender, item, inline, first)
        except RuntimeError:  # the sender thread is gone (after finalize): answer directly
            if isinstance(item, Failure):
                self._send_error_now(sender, item.message, item.code)

    def _decode_token(self, token_id: int) -> str:
        return str(self._engine.tokenizer.decode([token_id]))

    def _on_output(self, stream: _Stream, output: RequestOutput) -> None:
        """Loop thread: build the tensors now (cheap), send them from the sender thread."""
        latency_trace.mark("stub.output", stream.request_id)
        if stream.ended:
            return
        if output.finished and any(delta.finish_reason == "abort" for delta in output.outputs):
            self._end_with_error(stream, "request was cancelled", "CANCELLED")
            return
        if output.finished and not self._claim_end(stream):
            return
        tensors = stream.assembler.add(output)
        if tensors is not None or output.finished:
            # A lone stream's tokens are sent from this (the loop) thread: one thread switch less per token;
            # under load a first token goes ahead of the other streams' next ones.
            first, stream.answered = not stream.answered, True
            self._push(stream.request_id, stream.sender, Data(tensors, output.finished),
                       inline=len(self._streams) <= 1, first=first)

    def _send(self, sender: Any, tensors: Tensors | None, final: bool) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            if tensors is None:
                sender.send(flags=flags)
            else:
                outputs = [pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in tensors.items()]
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)
        except Exception as error:  # the client may be gone; cancellation polling ends the request
            self._logger.log_verbose(f"[pagedllm] could not send a response: {error}")

    def _send_error_now(self, sender: Any, message: str, code: str) -> None:
        triton_code = getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, triton_code)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as error:
            self._logger.log_verbose(f"[pagedllm] could not send an error response: {error}")

    def _stop_serving(self) -> None:
        """End every in-flight request with an UNAVAILABLE error and refuse new ones (SIGTERM, finalize)."""
        self._logger.log_info("[pagedllm] stopping: ending in-flight requests")
        # The loop fails its in-flight requests as it stops; if a step is stuck, we do it here.
        if not self._loop.stop(timeout_s=0.5 * FINALIZE_BUDGET_S):
            self._logger.log_error("[pagedllm] engine loop did not stop in time; ending its requests here")
        with self._streams_lock:
            left = list(self._streams.values())
        for stream in left:
            self._end_with_error(stream, "the model is shutting down", "UNAVAILABLE")

    def finalize(self) -> None:
        """End every in-flight request with a final response and stop, within ``FINALIZE_BUDGET_S``."""
        deadline = time.monotonic() + FINALIZE_BUDGET_S
        self._stop_serving()
        if isinstance(self._engine, EngineCoreProcess):
            self._engine.close(timeout_s=2.0)
        if self._server_threads is not None:
            self._server_threads.release()
        self._dispatcher.close(timeout_s=max(0.1, deadline - time.monotonic() - 1.0))
        self._watcher.close(timeout_s=0.5)
        if self._metrics is not None:
            self._metrics.close(timeout_s=0.5)
