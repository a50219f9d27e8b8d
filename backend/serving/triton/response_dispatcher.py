"""Send Triton responses from one thread, in order per request, merging a request's backlog.

Each ``response_sender.send`` is an IPC round trip (measured: RESULTS.md, "Figures behind
the code's choices"), so at high concurrency sending can fall behind the engine. Each
request has an outbox; the sender thread serves requests in the order they became
ready and sends everything waiting in an outbox as one response (texts concatenated,
token counts summed; see ``response_codec.merge_tensors``). When sending keeps up,
that is exactly one response per engine step; when it does not, clients get fewer,
larger responses instead of growing latency. Errors are never merged: an error ends
its request with the FINAL flag.

A caller may ask for ``inline`` delivery: when nothing is queued or being sent, the item is
sent on the caller's thread at once, which spares a lone stream one thread switch (and its
wait for the interpreter lock) per token. The Triton model asks for it while it serves a
single request; under load everything goes through the sender thread, as before. At most
one send runs at a time either way, so each request's responses stay in order.

A request's first response may jump the queue (``first``): under load the requests ready
before it are other streams' next tokens, a few milliseconds of sends that a user waiting
for the first token would otherwise sit behind (time to first token), while a stream
already running loses one send's time.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.engine import latency_trace
from pagedllm.serving.triton.response_codec import Tensors, merge_tensors

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Data:
    tensors: Tensors | None  # None: only the FINAL flag
    final: bool


@dataclass(frozen=True, slots=True)
class Failure:
    message: str
    code: str  # a pb_utils.TritonError code name, e.g. "INVALID_ARG"


SendData = Callable[[Any, Tensors | None, bool], None]
SendFailure = Callable[[Any, str, str], None]


class ResponseDispatcher:
    def __init__(self, send_data: SendData, send_failure: SendFailure) -> None:
        self._send_data = send_data
        self._send_failure = send_failure
        self._outboxes: dict[str, tuple[Any, list[Data | Failure]]] = {}
        self._ready: deque[str] = deque()
        self._changed = threading.Condition()
        self._sending = False  # a delivery is under way, on the sender thread or inline
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-sender", daemon=True)
        self._thread.start()

    def push(self, key: str, target: Any, item: Data | Failure, inline: bool = False, first: bool = False) -> None:
        """Queue ``item`` for the request ``key`` (``target`` is its response sender); with ``inline``, send
        it on this thread instead when nothing else is queued or being sent; with ``first`` (the request's
        first response), ahead of the requests already waiting."""
        with self._changed:
            if self._closing:
                raise RuntimeError("response dispatcher is closed")
            inline = inline and not self._sending and not self._outboxes
            if inline:
                self._sending = True
            elif key in self._outboxes:
                self._outboxes[key][1].append(item)
            else:
                self._outboxes[key] = (target, [item])
                if first:
                    self._ready.appendleft(key)
                else:
                    self._ready.append(key)
                self._changed.notify()
        if inline:
            try:
                self._deliver(key, target, [item])
            finally:
                with self._changed:
                    self._sending = False
                    self._changed.notify()  # pushes that queued meanwhile wait for the sender thread

    def close(self, timeout_s: float = 30.0) -> None:
        """Send everything queued (for at most ``timeout_s``), then stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("response sender did not finish within %.1f s", timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not (self._ready and not self._sending) and not (self._closing and not self._ready):
                    self._changed.wait()
                if not self._ready:
                    return
                key = self._ready.popleft()
                target, items = self._outboxes.pop(key)
                self._sending = True
            try:
                self._deliver(key, target, items)
            finally:
                with self._changed:
                    self._sending = False

    def _deliver(self, key: str, target: Any, items: list[Data | Failure]) -> None:
        pending: list[Data] = []
        for item in items:
            if isinstance(item, Data):
                pending.append(item)
                continue
            self._flush(key, target, pending)
            pending = []
            self._guarded(self._send_failure, target, item.message, item.code)
        self._flush(key, target, pending)

    def _flush(self, key: str, target: Any, pending: list[Data]) -> None:
        if not pending:
            return
        chunks = [item.tensors for item in pending if item.tensors is not None]
        merged = merge_tensors(chunks) if chunks else None
        self._guarded(self._send_data, target, merged, any(item.final for item in pending))
        latency_trace.mark("stub.sent", key)

    @staticmethod
    def _guarded(send: Callable[..., None], *args: Any) -> None:
        try:
            send(*args)
        except Exception:
            log.exception("sending a response failed")
