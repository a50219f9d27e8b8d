"""Run the pytriton wheel's tritonserver with the ``pagedllm`` backend, from tests, benchmarks or the CLI."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from pagedllm.platform.processes import die_with_parent, exit_code_of_zombie, free_port, is_zombie
from pagedllm.serving.backend_dir import assemble_backend_dir
from pagedllm.serving.server_placement import forget_server
from pagedllm.serving.stub_env import stub_env_dir
from pagedllm.serving.triton_files import find_triton_files, interpreter_library_dir

def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launching thread dies (Linux).

    The server runs in its own session (so a terminal's Ctrl-C reaches only the launcher,
    which then stops it cleanly); this keeps a killed launcher from leaving it orphaned.
    """
    die_with_parent(signal.SIGTERM)


def _group_members(group: int) -> list[tuple[int, list[bytes]]]:
    """(pid, command line) of every live process in process group ``group``."""
    members = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != group:
                continue
            members.append((int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")))
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return members


def _shm_regions(members: list[tuple[int, list[bytes]]]) -> list[str]:
    """The shared-memory regions the Python backend stubs among ``members`` name on their command lines."""
    return [a.decode() for _, arguments in members for a in arguments if a.startswith(b"triton_") and b"shm_region" in a]


def _reap_stubs(group: int) -> None:
    """Kill backend stubs a dead server left behind, and remove their shared-memory regions.

    A server that exits without unloading its models (its exit timeout expired with
    requests in flight, it crashed, or we killed it) orphans its Python backend stubs:
    they stay alive holding the model. They share the server's process group, and each
    names its shared-memory region on its command line.
    """
    regions = _shm_regions(_group_members(group))
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        return  # the server shut down cleanly: nothing left in its group
    for region in regions:
        (Path("/dev/shm") / region).unlink(missing_ok=True)
    _wait_until_empty(group, timeout_s=5.0)


def _wait_until_empty(group: int, timeout_s: float) -> None:
    """Wait for the killed members of ``group`` to go (they are not our children: we cannot reap them)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(not is_zombie(pid) for pid, _ in _group_members(group)):
        time.sleep(0.05)


@dataclass(frozen=True, slots=True)
class BackendStub:
    """A Python backend stub process serving one instance of a model."""

    pid: int
    model: str  # the model's folder name in the repository (its Triton name)


def _stub_model(arguments: list[bytes]) -> str | None:
    """The model a stub serves, from its command line (``<stub> <repo>/<model>/<version>/model.py ...``)."""
    if len(arguments) < 2 or not arguments[0].endswith(b"triton_python_backend_stub"):
        return None
    return Path(arguments[1].decode(errors="replace")).parent.parent.name


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a dead child of another process ended: its waitpid status, None once it was reaped."""

    status: int | None

    @property
    def abnormal(self) -> bool:
        return self.status is not None and self.status != 0

    def __str__(self) -> str:
        if self.status is None:
            return "exit status unknown"
        if self.status & 0x7F:
            return f"killed by signal {self.status & 0x7F} ({signal.Signals(self.status & 0x7F).name})"
        return f"exited with code {self.status >> 8}"


def exit_status(pid: int) -> ExitStatus:
    """Read from the zombie's ``/proc`` entry while it lasts (field 52, exit_code: Linux >= 3.5)."""
    return ExitStatus(exit_code_of_zombie(pid))


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


class TritonServer:
    """A tritonserver process serving ``model_repository`` with the ``pagedllm`` backend.

    Ports left as ``None`` are picked free. ``log_path=None`` writes the server log to
    a file in the server's scratch folder, removed with it by ``stop()`` (read it before
    with ``log_tail()``, or pass a path to keep it); ``log_path="-"`` lets the server
    share this process's stdout/stderr. Failing to start raises with the log's tail.

    The server runs with ``--model-control-mode=explicit --load-model=*``: every model
    loads at start as in the default mode, and a model whose engine died can unload
    itself (``pb_utils.unload_model``), so its readiness tells the truth.

    ``stop()`` is bounded (see there); ``kill()`` ends everything at once.
    """

    def __init__(
        self,
        model_repository: str | Path,
        *,
        grpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        host: str = "127.0.0.1",
        log_path: str | Path | None = None,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        exit_timeout_s: int = 8,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise ValueError(f"model_repository {self.model_repository} is not a folder")
        self.host = host
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self._log_target = log_path
        self.log_path: Path | None = None
        self._log_verbose = log_verbose
        self._extra_args = tuple(extra_args)
        self._extra_env = dict(env or {})
        self._startup_timeout_s = startup_timeout_s
        self._exit_timeout_s = exit_timeout_s
        self._group: int | None = None  # the server's process group (its pid), while it may have members
        self._scratch: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self, backend_dir: Path) -> list[str]:
        files = find_triton_files()
        return [
            str(files.server_binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            f"--grpc-address={self.host}",
            f"--http-address={self.host}",
            f"--metrics-address={self.host}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--model-control-mode=explicit",
            "--load-model=*",
            f"--exit-timeout-secs={self._exit_timeout_s}",
            f"--log-verbose={self._log_verbose}",
            *self._extra_args,
        ]

    def environment(self) -> dict[str, str]:
        """This process's environment plus what the server and the backend stub need (see ``stub_env``)."""
        files = find_triton_files()
        env = dict(os.environ)
        libraries = [str(files.library_dir)]
        own_libpython = interpreter_library_dir()
        if own_libpython is not None:
            libraries.insert(0, str(own_libpython))
        if env.get("LD_LIBRARY_PATH"):
            libraries.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libraries)
        env["PATH"] = os.pathsep.join([str(stub_env_dir() / "bin"), env.get("PATH", os.defpath)])
        env.update(self._extra_env)
        return env

    def start(self) -> TritonServer:
        """Launch the server and block until it reports ready; raises ``RuntimeError`` with the log tail if not."""
        if self._process is not None:
            raise RuntimeError("server already started")
        self._scratch = Path(tempfile.mkdtemp(prefix="pagedllm-triton-"))
        backend_dir = assemble_backend_dir(self._scratch / "backends", find_triton_files())
        if self._log_target == "-":
            output: IO[bytes] | None = None
        else:
            self.log_path = Path(self._log_target) if self._log_target else self._scratch / "tritonserver.log"
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            output = self._log_file
        self._process = subprocess.Popen(
            self.command(backend_dir), env=self.environment(), stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        self._group = self._process.pid
        try:
            self._wait_ready(self._process)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {process.returncode}\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise RuntimeError(f"tritonserver not ready after {self._startup_timeout_s:.0f} s\n{self.log_tail()}")

    def log_tail(self, max_chars: int = 6000) -> str:
        if self._log_target == "-":
            return "(the server log went to the console)"
        if self.log_path is None or not self.log_path.exists():
            return "(no server log: the server was stopped and its scratch folder removed)"
        return self.log_path.read_text(errors="replace")[-max_chars:]

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stubs(self) -> list[BackendStub]:
        """The live Python backend stubs of this server (a dead one's zombie has no command line: it is left out)."""
        if self._group is None:
            return []
        stubs = []
        for pid, arguments in _group_members(self._group):
            model = _stub_model(arguments) if pid != self._group else None
            if model is not None:
                stubs.append(BackendStub(pid, model))
        return stubs

    def restart(self) -> None:
        """Kill the server and its stubs at once and start it again on the same ports (raises as ``start``)."""
        self.kill()
        self.stop(timeout_s=5.0)
        self.start()

    def wait(self) -> int:
        """Block until the server exits (for the CLI); returns its exit code."""
        if self._process is None:
            raise RuntimeError("server not started")
        return self._process.wait()

    def stop(self, timeout_s: float = 12.0) -> None:
        """Shut the server down within about ``timeout_s``, killing what overstays; idempotent.

        The backend stubs get SIGTERM first: a ``pagedllm`` model then ends its in-flight
        requests with an error at once, so the server is not held up waiting for long
        streams. The server gets SIGINT (models are unloaded, ``finalize`` runs). Whatever
        is still alive after ``timeout_s``, server or stub, gets SIGKILL, and the stubs'
        shared-memory regions are removed.

        Seen with the 2.51 server: while a client keeps a gRPC stream open, the model is
        never unloaded (it stays "live" after its last request ended), the server logs
        "Exit timeout expired. Exiting immediately." after ``exit_timeout_s`` and then
        hangs; the SIGKILL at ``timeout_s`` ends it. With clients gone it exits in ~3 s.
        """
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                for pid, arguments in _group_members(process.pid):
                    if arguments and arguments[0].endswith(b"triton_python_backend_stub"):
                        _send(pid, signal.SIGTERM)  # not the stubs' own children (an engine core process)
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.kill()
                    process.wait()
            _reap_stubs(process.pid)
            forget_server(process.pid)
            self._group = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
            if self.log_path is not None and not self.log_path.exists():
                self.log_path = None

    def kill(self) -> None:
        """SIGKILL the server and its stubs now (safe from a signal handler); ``stop()`` still cleans up."""
        group = self._group
        if group is not None:
            regions = _shm_regions(_group_members(group))
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for region in regions:
                (Path("/dev/shm") / region).unlink(missing_ok=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
