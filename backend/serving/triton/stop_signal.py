"""Run a callback on a thread when the backend stub gets SIGTERM: how ``pagedllm serve`` asks a model to drain.

Triton waits for every in-flight request before it unloads a model, so a server
stopping with long streams running sits out its whole exit timeout. The launcher
(``TritonServer.stop``) therefore sends the stubs SIGTERM before it sends the
server SIGINT, and the model ends its in-flight requests on that signal.

The stub's main thread spends its time in C++ waiting for messages, so a Python
signal handler would only run at the next ``execute``. Instead the handler is a
no-op and ``signal.set_wakeup_fd`` makes the interpreter's C-level handler write the
signal number to a pipe, which a thread here reads. Both calls work only on the
main thread (where Triton calls ``initialize``), and ``watch`` installs nothing
outside a backend stub process (a test or an offline user keeps its own signals);
then it returns False.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def watch(callback: Callable[[], None], signum: int = signal.SIGTERM) -> bool:
    """Call ``callback()`` once, on a daemon thread, when the process gets ``signum``; False if not installable."""
    if not _in_backend_stub():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.signal(signum, _ignore)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(read_fd)
        os.close(write_fd)
        return False
    threading.Thread(target=_wait, args=(read_fd, signum, callback), name="pagedllm-stop-signal",
                     daemon=True).start()
    return True


def _in_backend_stub() -> bool:
    try:
        return Path("/proc/self/exe").resolve().name == "triton_python_backend_stub"
    except OSError:
        return False


def _ignore(signum: int, frame: object) -> None:
    """The work happens on the watcher thread; this only keeps the default action (exit) away."""


def _wait(read_fd: int, signum: int, callback: Callable[[], None]) -> None:
    while True:
        select.select([read_fd], [], [])
        received = os.read(read_fd, 64)
        if not received:
            return
        if signum in received:
            try:
                callback()
            except Exception:
                log.exception("stop-signal callback failed")
            return
