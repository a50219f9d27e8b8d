"""The pieces of ``pagedllm serve``'s recovery that need no server: the supervision folder, exit statuses, giving up."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pagedllm.serving.server import BackendStub, ExitStatus, exit_status
from pagedllm.serving.supervisor_folder import InjectedEngineDeath, SupervisorFolder
from pagedllm.serving.supervisor import Supervisor, SupervisorGaveUp


def test_restart_counts_and_deaths_go_through_the_folder(tmp_path: Path) -> None:
    folder = SupervisorFolder(tmp_path)
    assert folder.restarts("llm") == 0
    folder.set_restarts("llm", 2)
    assert folder.restarts("llm") == 2 and folder.restarts("other") == 0
    folder.record_death("llm", "engine loop died: boom")
    assert folder.take_deaths() == {"llm": "engine loop died: boom"}
    assert folder.take_deaths() == {}


def test_the_environment_names_the_folder_and_switches_fault_injection(tmp_path: Path) -> None:
    assert SupervisorFolder.from_environment({}) is None
    plain = SupervisorFolder.from_environment({"PAGEDLLM_SUPERVISOR_DIR": str(tmp_path)})
    assert plain == SupervisorFolder(tmp_path, fault_injection=False)
    step = lambda: ["output"]  # noqa: E731
    assert plain.with_fault_hook("llm", step) is step  # no hook at all in production


def test_the_fault_hook_kills_exactly_one_step_when_asked(tmp_path: Path) -> None:
    folder = SupervisorFolder(tmp_path, fault_injection=True)
    step = folder.with_fault_hook("llm", lambda: ["output"])
    assert step() == ["output"]
    folder.request_engine_death("llm")
    with pytest.raises(InjectedEngineDeath):
        step()
    assert not isinstance(InjectedEngineDeath("x"), Exception)  # escapes the loop's `except Exception`
    assert step() == ["output"]


def test_exit_status_reads_a_zombie_and_says_how_it_ended() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while exit_status(child.pid).status is None and time.monotonic() < deadline:
            time.sleep(0.01)
        status = exit_status(child.pid)  # not reaped yet: still a zombie
        assert status.abnormal and str(status) == "killed by signal 9 (SIGKILL)"
    finally:
        child.wait()
    assert exit_status(child.pid) == ExitStatus(None) and not ExitStatus(None).abnormal
    assert str(ExitStatus(0)) == "exited with code 0" and not ExitStatus(0).abnormal
    assert str(ExitStatus(3 << 8)) == "exited with code 3" and ExitStatus(3 << 8).abnormal


class DeadServer:
    """A server that exited and will not come back."""

    http_url = "127.0.0.1:9"
    running = False

    def __init__(self) -> None:
        self.restarts = 0

    def stubs(self) -> list[BackendStub]:
        return []

    def restart(self) -> None:
        self.restarts += 1
        raise RuntimeError("tritonserver exited with code 1\nE1130 model.json: unknown key 'max_num_seqz'")


def test_the_supervisor_gives_up_after_max_reloads_failures_in_a_row_naming_the_last(tmp_path: Path) -> None:
    server = DeadServer()
    reports: list[str] = []
    supervisor = Supervisor(server, tmp_path, max_reloads=2, report=reports.append)  # type: ignore[arg-type]
    supervisor.check()  # the first failure is reported, not fatal
    with pytest.raises(SupervisorGaveUp, match="gave up after 2 failed restarts in a row.*max_num_seqz"):
        supervisor.check()
    assert server.restarts == 2
    assert any("tritonserver is not running" in line for line in reports)


class FlakyServer(DeadServer):
    """Comes back at every restart, and its engine dies again straight away."""

    running = True

    def restart(self) -> None:
        self.restarts += 1


def test_an_engine_that_dies_right_after_each_restart_is_a_crash_loop(tmp_path: Path) -> None:
    server = FlakyServer()
    folder = SupervisorFolder(tmp_path)
    reports: list[str] = []
    supervisor = Supervisor(server, tmp_path, max_reloads=2, crash_loop_s=60, report=reports.append)  # type: ignore[arg-type]
    supervisor._reload = lambda model, cause: supervisor._restart_server(model, cause)  # type: ignore[method-assign]
    folder.record_death("llm", "engine loop died: WorkerDied: rank 1 was killed by SIGKILL")
    supervisor.check()  # restarted, on probation
    folder.record_death("llm", "engine loop died: WorkerDied: rank 1 was killed by SIGKILL")
    supervisor.check()  # died again at once: the first failed restart
    folder.record_death("llm", "engine loop died: WorkerDied: rank 1 was killed by SIGKILL")
    with pytest.raises(SupervisorGaveUp, match="crash loop.*rank 1 was killed by SIGKILL"):
        supervisor.check()


def test_a_restart_that_outlives_its_probation_clears_the_failures(tmp_path: Path) -> None:
    server = FlakyServer()
    folder = SupervisorFolder(tmp_path)
    supervisor = Supervisor(server, tmp_path, max_reloads=2, crash_loop_s=0.0, report=lambda _: None)  # type: ignore[arg-type]
    supervisor._reload = lambda model, cause: supervisor._restart_server(model, cause)  # type: ignore[method-assign]
    for _ in range(5):  # each death comes after the (zero-length) probation: never a crash loop
        folder.record_death("llm", "engine loop died")
        supervisor.check()
    assert server.restarts == 5


def test_max_reloads_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_reloads"):
        Supervisor(DeadServer(), tmp_path, max_reloads=0)  # type: ignore[arg-type]


def test_a_reload_waits_until_triton_has_taken_up_the_models_own_unload(tmp_path: Path) -> None:
    """``pb_utils.unload_model`` returns before Triton acts on it; a load sent while the model still
    reads READY would be a no-op, and the unload landing after it would leave the model unloaded."""
    server = DeadServer()
    reports: list[str] = []
    supervisor = Supervisor(server, tmp_path, max_reloads=5, report=reports.append)  # type: ignore[arg-type]
    states = iter(["READY", "READY", "UNLOADING"])
    asked: list[str] = []

    def model_state(model: str) -> str | None:
        asked.append(model)
        return next(states)

    supervisor._model_state = model_state  # type: ignore[method-assign]
    supervisor._reload("llm", "engine loop died: boom")
    assert asked == ["llm"] * 3  # polled until the unload showed, then loaded (refused by the dead server)
    assert reports[-1].startswith("pagedllm: reloading model 'llm' failed")
