"""The folder through which ``pagedllm serve``'s supervisor and the model instances it restarts talk.

A restart replaces the backend stub (and with it every Python object of the model),
so whatever must outlive one lives in a folder the launcher owns and names in the
``PAGEDLLM_SUPERVISOR_DIR`` environment variable, which tritonserver passes on to
its stubs:

* ``<model>.restarts``: how many times the supervisor restarted the model; a new
  instance publishes it as ``pagedllm:engine_restarts_total``.
* ``<model>.death``: written by a model instance whose engine loop died, with the
  reason, just before it unloads itself; the supervisor reloads the model, logs the
  reason and removes the file. (A model unloaded by an operator leaves no such file
  and stays unloaded.)
* ``<model>.inject-engine-death``: a test hook, read only when
  ``PAGEDLLM_FAULT_INJECTION=1``: the next engine step of that model raises
  ``InjectedEngineDeath`` (a ``BaseException``, which kills the engine loop).

Outside ``pagedllm serve`` (no such variable) ``from_environment()`` is None and
a model behaves as before.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

DIR_VARIABLE = "PAGEDLLM_SUPERVISOR_DIR"
FAULT_INJECTION_VARIABLE = "PAGEDLLM_FAULT_INJECTION"

T = TypeVar("T")


class InjectedEngineDeath(BaseException):
    """Raised by the fault-injection hook; escapes every ``except Exception`` as a real engine bug would."""


@dataclass(frozen=True, slots=True)
class SupervisorFolder:
    path: Path
    fault_injection: bool = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> SupervisorFolder | None:
        folder = environ.get(DIR_VARIABLE)
        if not folder:
            return None
        return cls(Path(folder), fault_injection=environ.get(FAULT_INJECTION_VARIABLE) == "1")

    def restarts(self, model: str) -> int:
        try:
            return int(self._file(model, "restarts").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def set_restarts(self, model: str, count: int) -> None:
        self._write(self._file(model, "restarts"), str(count))

    def record_death(self, model: str, reason: str) -> None:
        self._write(self._file(model, "death"), reason)

    def take_deaths(self) -> dict[str, str]:
        """The recorded deaths (model name -> reason), removing them."""
        deaths = {}
        for marker in self.path.glob("*.death"):
            try:
                deaths[marker.stem] = marker.read_text()
                marker.unlink()
            except FileNotFoundError:
                continue
        return deaths

    def request_engine_death(self, model: str) -> None:
        """Test hook: make ``model``'s engine loop die at its next step (needs fault injection enabled)."""
        self._write(self._file(model, "inject-engine-death"), "")

    def with_fault_hook(self, model: str, step: Callable[[], T]) -> Callable[[], T]:
        """``step`` wrapped so that a requested injected death happens; ``step`` itself when injection is off."""
        if not self.fault_injection:
            return step
        trigger = self._file(model, "inject-engine-death")

        def checked_step() -> T:
            if trigger.exists():
                trigger.unlink(missing_ok=True)
                raise InjectedEngineDeath(f"injected engine death ({trigger})")
            return step()

        return checked_step

    def _file(self, model: str, kind: str) -> Path:
        return self.path / f"{model}.{kind}"

    @staticmethod
    def _write(path: Path, text: str) -> None:
        """Write via a rename so a reader never sees half a file."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        partial.replace(path)
