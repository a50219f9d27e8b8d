"""tritonserver's threads move off the engine core's CPUs while a bound model is loaded, and back after.

First on a stand-in server process (a Python interpreter with a few threads), for the
record a restarted stub reads; then on a real tritonserver with a bound model.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from pagedllm.engine.core_process import CHILD_MARKER
from pagedllm.platform.processes import child_pids
from pagedllm.serving.server import TritonServer
from pagedllm.serving.server_placement import TritonServerThreads, forget_server

ALLOWED = frozenset(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="moving threads off the engine's CPUs needs two CPUs")

THREADED = "import threading, time\n[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]\n" \
           "print('ready', flush=True)\ntime.sleep(60)\n"


def thread_cpus(pid: int) -> list[frozenset[int]]:
    return [frozenset(os.sched_getaffinity(int(task))) for task in os.listdir(f"/proc/{pid}/task")]


@pytest.fixture
def stand_in() -> Iterator[int]:
    process = subprocess.Popen([sys.executable, "-c", THREADED], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    yield process.pid
    process.kill()
    process.wait()
    forget_server(process.pid)


def test_confined_threads_get_the_servers_cpus_back_and_a_restarted_stub_sees_them(stand_in: int) -> None:
    serving = frozenset({min(ALLOWED)})
    server = TritonServerThreads.of(stand_in)
    assert server.cpus == ALLOWED
    server.confine(serving)
    assert thread_cpus(stand_in) == [serving] * 4  # the main thread and its three others
    # A stub restarted after a crash sees only the serving CPUs on the server's threads, and reads the record.
    assert TritonServerThreads.of(stand_in).cpus == ALLOWED
    server.release()
    assert thread_cpus(stand_in) == [ALLOWED] * 4
    assert not server.record.exists()
    assert TritonServerThreads.of(stand_in).cpus == ALLOWED


def test_the_launcher_forgets_a_killed_servers_record(stand_in: int) -> None:
    server = TritonServerThreads.of(stand_in)
    server.confine(frozenset({min(ALLOWED)}))
    assert server.record.exists()
    forget_server(stand_in)
    assert not server.record.exists()


def test_a_parent_other_than_tritonserver_is_left_alone() -> None:
    assert TritonServerThreads.parent() is None  # pytest's parent is a shell or a CI runner


def _engine_child(server_pid: int) -> int:
    for stub in child_pids(server_pid):
        for child in child_pids(stub):
            if CHILD_MARKER.encode() in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    raise AssertionError("no engine core process under the server")


@pytest.mark.tritonserver
@pytest.mark.server
def test_a_bound_model_moves_tritonservers_threads_and_unloading_it_gives_them_back(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    engine_cpu, serving = frozenset({max(ALLOWED)}), ALLOWED - {max(ALLOWED)}
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    bundled = Path(__file__).resolve().parents[1] / "model_repository" / "llm" / "config.pbtxt"
    (tmp_path / "llm" / "config.pbtxt").write_text(bundled.read_text())
    (version / "model.json").write_text(json.dumps({
        "model": str(tiny_model_dir("llama")), "dtype": "float32", "device": "cpu", "max_model_len": 128,
        "num_kv_blocks": 32, "cpu_bind": "auto"}))
    with TritonServer(tmp_path, env={"OMP_NUM_THREADS": "1"}) as server:
        assert server._process is not None
        pid = server._process.pid
        assert set(thread_cpus(pid)) == {serving}
        assert frozenset(os.sched_getaffinity(_engine_child(pid))) == engine_cpu
        requests.post(f"http://{server.http_url}/v2/repository/models/llm/unload", timeout=30).raise_for_status()
        deadline = time.monotonic() + 60
        while set(thread_cpus(pid)) != {ALLOWED} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(thread_cpus(pid)) == {ALLOWED}
        assert not list(Path(tempfile.gettempdir()).glob(f"pagedllm-tritonserver-{pid}-*"))


# A stand-in server whose "stub" child runs an engine core (a process with the engine child's command line).
ENGINE = f"{CHILD_MARKER}; import os, time; print(os.getpid(), flush=True); time.sleep(60)"
SPAWN = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]]); time.sleep(60)"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_server_stays_confined_while_another_engine_core_runs_under_it() -> None:
    """A reload loads the new instance beside the old one; the old one's finalize must not unbind the new one's
    server."""
    server_process = subprocess.Popen([sys.executable, "-c", SPAWN, SPAWN, ENGINE], stdout=subprocess.PIPE,
                                      text=True, start_new_session=True)
    try:
        assert server_process.stdout is not None
        engine = int(server_process.stdout.readline())
        serving = frozenset({min(ALLOWED)})
        server = TritonServerThreads.of(server_process.pid)
        server.confine(serving)
        server.release()  # the other instance's engine core still runs
        assert set(thread_cpus(server_process.pid)) == {serving} and server.record.exists()
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _cmdline(engine) and time.monotonic() < deadline:  # empty once gone, or a zombie nobody reaps here
            time.sleep(0.1)
        server.release()
        assert set(thread_cpus(server_process.pid)) == {ALLOWED} and not server.record.exists()
    finally:
        os.killpg(server_process.pid, signal.SIGKILL)
        server_process.wait()
        forget_server(server_process.pid)
