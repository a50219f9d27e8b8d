"""Per-hop timestamps of requests along the serving path, kept only when ``PAGEDLLM_LATENCY_TRACE`` is set.

Every process a token crosses (the OpenAI door, the Triton stub, the engine core child)
calls :func:`mark` at its hops. With ``PAGEDLLM_LATENCY_TRACE=<folder>`` in the
environment (children inherit it), each process appends ``hop<TAB>key<TAB>ns`` lines
to ``<folder>/trace-<pid>.tsv``; ``ns`` is ``CLOCK_MONOTONIC``, one clock for every
process of a host, so the hops of one request line up across processes.
``pagedllm bench latency`` (``pagedllm_bench.latency``) reads them back.
Unset, :func:`mark` is one global test: nothing is timed or written.

``key`` is the part of a request id before its first ``-``: the door's uuid, which the stub
keeps as the head of its own id (``<triton id>-<uuid>``), so one key follows a request
from the door to the engine and back.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path
from typing import TextIO

TRACE_ENV = "PAGEDLLM_LATENCY_TRACE"

_sink: TextIO | None = None
_lock = threading.Lock()


def _open_sink() -> TextIO | None:
    folder = os.environ.get(TRACE_ENV)
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    # Line-buffered: a server stopped with a signal still leaves every line it wrote.
    sink = open(Path(folder) / f"trace-{os.getpid()}.tsv", "a", buffering=1)  # noqa: SIM115 (process-long)
    atexit.register(sink.close)
    return sink


def key(request_id: str) -> str:
    """The part of ``request_id`` every hop shares (see the module docstring)."""
    return request_id.split("-", 1)[0]


def mark(hop: str, request_id: str) -> None:
    """Record that ``request_id`` passed ``hop`` now (a no-op unless tracing is on)."""
    if _sink is None:
        return
    line = f"{hop}\t{key(request_id)}\t{time.monotonic_ns()}\n"
    with _lock:
        _sink.write(line)


def enabled() -> bool:
    return _sink is not None


_sink = _open_sink()
