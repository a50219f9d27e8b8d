"""Keep ``pagedllm serve``'s models serving: notice a dead engine, restart it, give up after repeated failures.

Two ways an engine dies, two ways back (measured on the 2.51 server of the pytriton wheel):

* **The engine loop dies** while its stub lives. The model fails its in-flight
  streams ("...; the engine is restarting"), records why in the supervision folder
  (``serving.supervision``) and unloads itself, which turns its readiness false. The
  supervisor reloads it (``POST /v2/repository/models/<name>/load``); the server and
  the other models keep running.
* **The backend stub dies** (``kill -9``, the OOM killer, a crash in native code).
  Triton keeps the model READY and answers every new request "Stub process ... is
  not healthy". Its in-flight decoupled streams hang for good: their response
  factories lived in the dead stub's bookkeeping and Triton never ends them, and the
  model version they pin can never finish unloading, so a model reload would leave
  those clients waiting forever and the old version resident. The supervisor
  therefore restarts tritonserver itself (same ports): readiness is false at once,
  every client connection ends with an error, and the server comes back with fresh
  stubs.

Each restart is logged with its cause and counted per model in the supervision
folder, from which the new instance publishes ``pagedllm:engine_restarts_total``.
After ``max_reloads`` failed restarts in a row ``check`` raises ``SupervisorGaveUp``
naming the last failure; one attempt is bounded by ``reload_timeout_s``. A restart
counts as failed too when the engine dies again within ``crash_loop_s`` of it (a
crash loop: the restart "worked", the engine did not), so a model that can never
stay up ends ``pagedllm serve`` with its cause instead of restarting forever.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pagedllm.serving.server import TritonServer, exit_status
from pagedllm.platform.processes import is_zombie
from pagedllm.serving.supervisor_folder import SupervisorFolder

DEFAULT_MAX_RELOADS = 3
DEFAULT_RELOAD_TIMEOUT_S = 300.0
DEFAULT_CRASH_LOOP_S = 60.0
UNLOAD_START_TIMEOUT_S = 10.0
# A full scan of /proc for stubs reads every process's command line: ~30% of the launcher's samples at
# 4 checks a second on a busy host, taken from the OpenAI door's thread. Between scans, the stubs already
# known are checked one file each, and a scan runs at once when one of them is gone.
FULL_SCAN_EVERY_S = 5.0


class SupervisorGaveUp(RuntimeError):
    """Restarting failed ``max_reloads`` times in a row; the message says why."""


class Supervisor:
    """Call ``check()`` every fraction of a second from the launcher's main loop."""

    def __init__(self, server: TritonServer, folder: Path, *, max_reloads: int = DEFAULT_MAX_RELOADS,
                 reload_timeout_s: float = DEFAULT_RELOAD_TIMEOUT_S, crash_loop_s: float = DEFAULT_CRASH_LOOP_S,
                 report: Callable[[str], None] = print) -> None:
        if max_reloads < 1:
            raise ValueError(f"max_reloads must be >= 1, got {max_reloads}")
        self._server = server
        self._folder = SupervisorFolder(folder)
        self._max_reloads = max_reloads
        self._reload_timeout_s = reload_timeout_s
        self._report = report
        self._failures = 0  # failed restarts in a row
        self._crash_loop_s = crash_loop_s
        self._on_probation_until = 0.0  # a death before then fails the last restart
        self._stubs: dict[int, str] = {}  # pid -> model, as last seen
        self._scanned_at = 0.0

    def watch(self, *, ignore: frozenset[int] = frozenset()) -> None:
        """Start watching (after the server is up): remember its stubs, except ``ignore`` (ones being retired)."""
        self._stubs = {stub.pid: stub.model for stub in self._server.stubs() if stub.pid not in ignore}
        self._scanned_at = time.monotonic()

    def check(self) -> None:
        """One round: restart what died; raises ``SupervisorGaveUp`` after too many failures in a row."""
        if self._on_probation_until and time.monotonic() >= self._on_probation_until:
            self._failures, self._on_probation_until = 0, 0.0  # the last restart held
        if not self._server.running:
            self._restart_server(None, "tritonserver is not running (it exited, or did not come back)")
            return
        deaths = self._folder.take_deaths()
        if deaths:
            for model, reason in deaths.items():
                self._reload(model, reason)
            return
        now = time.monotonic()
        if now - self._scanned_at < FULL_SCAN_EVERY_S and not any(is_zombie(pid) for pid in self._stubs):
            return
        self._scanned_at = now
        seen = {stub.pid: stub.model for stub in self._server.stubs()}
        for pid, model in self._stubs.items():
            if pid in seen:
                continue
            ending = exit_status(pid)
            # A stub Triton retired exits 0 and is reaped at once (then its status is unknown) while
            # another serves the model; one that died under a model Triton still lists as ready did not.
            if (ending.abnormal or model not in seen.values()) and self._model_state(model) == "READY":
                self._restart_server(model, f"backend stub of model {model!r} (pid {pid}) died: {ending}")
                return
        self._stubs = seen

    def _restart_server(self, model: str | None, cause: str) -> None:
        self._count_restart(model, cause, "restarting tritonserver")
        try:
            self._server.restart()
        except RuntimeError as error:
            self._failed(f"tritonserver did not come back: {_summary(str(error))}")
            return
        self._succeeded()

    def _reload(self, model: str, cause: str) -> None:
        # Not waiting for the old instance to go: Triton keeps it until every client stream it
        # served is closed, and loads the new one beside it meanwhile. Its stub exits whenever
        # that happens, which is not a death to act on.
        retiring = frozenset(pid for pid, name in self._stubs.items() if name == model)
        self._count_restart(model, cause, f"reloading model {model!r}")
        self._wait_for_unload(model)
        url = f"http://{self._server.http_url}/v2/repository/models/{model}/load"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"),
                                        timeout=self._reload_timeout_s):
                pass
        except urllib.error.HTTPError as error:
            self._failed(f"reloading model {model!r} failed: {_error_text(error)}")
            self._folder.record_death(model, cause)  # try again next round
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            self._failed(f"reloading model {model!r} failed: {error}")
            self._folder.record_death(model, cause)
            return
        self._succeeded(retiring)

    def _wait_for_unload(self, model: str) -> None:
        """Until Triton has taken up the unload the dying model asked for (``pb_utils.unload_model``
        returns before Triton acts on it), at most ``UNLOAD_START_TIMEOUT_S``: a load that reached
        Triton first would find the model still ready and do nothing, and the unload that followed
        would leave it unloaded for good."""
        deadline = time.monotonic() + UNLOAD_START_TIMEOUT_S
        while self._model_state(model) == "READY" and time.monotonic() < deadline:
            time.sleep(0.1)

    def _count_restart(self, model: str | None, cause: str, action: str) -> None:
        since = time.monotonic() - (self._on_probation_until - self._crash_loop_s)
        if time.monotonic() < self._on_probation_until:
            self._failed(f"the engine died again {since:.0f} s after its restart (a crash loop): {cause}")
        models = [model] if model is not None else sorted(set(self._stubs.values()))
        for name in models:
            self._folder.set_restarts(name, self._folder.restarts(name) + 1)
        counts = ", ".join(f"{name}: restart #{self._folder.restarts(name)}" for name in models)
        self._report(f"pagedllm: {cause}; {action} ({counts or 'no model known'})")

    def _failed(self, reason: str) -> None:
        self._failures += 1
        self._report(f"pagedllm: {reason}")
        if self._failures >= self._max_reloads:
            raise SupervisorGaveUp(f"gave up after {self._failures} failed restarts in a row; last: {reason}")

    def _succeeded(self, retiring: frozenset[int] = frozenset()) -> None:
        # Not counted as held yet: _failures is cleared once the engine outlives its probation.
        self._on_probation_until = time.monotonic() + self._crash_loop_s
        self._report("pagedllm: serving again")
        self.watch(ignore=retiring)

    def _model_state(self, model: str) -> str | None:
        """The model's state in the repository index (READY, UNLOADING, UNAVAILABLE, ...), None if unknown."""
        url = f"http://{self._server.http_url}/v2/repository/index"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=5) as answer:
                index = json.loads(answer.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            return None
        states = [entry.get("state") for entry in index if entry.get("name") == model]
        return states[0] if states else None


def _error_text(error: urllib.error.HTTPError) -> str:
    body = error.read().decode(errors="replace")
    try:
        return str(json.loads(body).get("error", body))
    except (json.JSONDecodeError, AttributeError):
        return body or str(error)


def _summary(text: str) -> str:
    """The first line of a server failure and its log's last error line (the full tail was already printed)."""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E")]
    return " / ".join(dict.fromkeys(lines[:1] + errors[-1:]))
