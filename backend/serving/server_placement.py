"""Moving tritonserver's own threads off the CPUs the engine core binds, and back.

``cpu_bind`` (:mod:`pagedllm.platform.cpu_binding`) gives the engine child CPUs of its
own and moves the stub's threads to the rest. tritonserver's gRPC/HTTP threads handle
every streamed response too, and left unbound the kernel's load balancer moves them
(and any load client on the host) onto the engine's CPUs whenever the serving CPUs are
busy, where they preempt a decode step. On the 2-core CPU host at 64 streams the engine
child got 0.67-0.80 of its CPU that way; see docs/results/RESULTS.md, "Serving", for the
side-by-side numbers with and without this move.

So when the engine binds, every thread of the stub's parent tritonserver is restricted
to the serving CPUs (threads it starts later inherit that), and ``release`` gives them
back the server's CPUs when the model unloads, unless another engine core still runs
under the server: a reload loads the new instance beside the old one, whose ``finalize``
comes later, and it must not unbind the new one's server. Other models served by the
same tritonserver share the serving CPUs meanwhile: with ``cpu_bind`` set, the engine
owns its CPUs (``cpu_bind: "off"`` leaves all placement to the kernel).

A stub that Triton restarts after a crash inherits the moved threads' affinity, not the
server's. The server's own CPUs are therefore recorded, the first time a stub moves
them, in a file named by the server's pid and start time (never mistaken for another
process's), and read back by the next stub; ``release`` removes it, and so does the
launcher (``forget_server``) once a server it started has exited without unloading.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedllm.platform.cpu_binding import parse_cpu_list, pin_process
from pagedllm.platform.processes import parent_pid, start_time

log = logging.getLogger(__name__)

SERVER_EXECUTABLE = "tritonserver"
RECORD_PREFIX = "pagedllm-tritonserver-"


@dataclass(frozen=True, slots=True)
class TritonServerThreads:
    pid: int
    cpus: frozenset[int]  # the server's CPUs before any pagedllm model moved its threads
    record: Path

    @classmethod
    def parent(cls) -> TritonServerThreads | None:
        """The tritonserver this stub runs under; ``None`` when the parent is anything else (tests,
        library use)."""
        pid = os.getppid()
        try:
            executable = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            return None
        return cls.of(pid) if executable == SERVER_EXECUTABLE else None

    @classmethod
    def of(cls, pid: int) -> TritonServerThreads:
        record = Path(tempfile.gettempdir()) / f"{RECORD_PREFIX}{pid}-{start_time(pid)}.cpus"
        try:
            cpus = parse_cpu_list(record.read_text())
        except (OSError, ValueError):
            cpus = frozenset(os.sched_getaffinity(pid))
        return cls(pid, cpus, record)

    def confine(self, cpus: frozenset[int]) -> None:
        """Restrict every thread of the server to ``cpus``; logs and leaves them as they are if it may not."""
        try:
            self._write_record()
            pin_process(cpus, self.pid)
        except OSError as error:
            log.warning("could not move tritonserver's threads to CPUs %s (%s); they stay unbound", sorted(cpus),
                        error)
            return
        log.info("tritonserver's threads moved to CPUs %s, off the engine core's", sorted(cpus))

    def release(self) -> None:
        """Give every thread of the server its CPUs back, once no engine core runs under it (call it after
        this stub's own engine core has stopped)."""
        if _engine_cores_under(self.pid):
            return
        try:
            pin_process(self.cpus, self.pid)
            self.record.unlink(missing_ok=True)
        except OSError as error:
            log.warning("could not give tritonserver's threads their CPUs %s back: %s", sorted(self.cpus), error)

    def _write_record(self) -> None:
        # O_EXCL: of two stubs confining at once, the first writes what it read before anything moved.
        try:
            descriptor = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(descriptor, "w") as record:
            record.write(",".join(map(str, sorted(self.cpus))))


def run_beside(server_pid: int) -> None:
    """Move this process's threads to the CPUs tritonserver ``server_pid`` runs on now. Once a bound model
    has loaded those are the serving CPUs, so a front door in this process (``pagedllm serve``'s OpenAI
    server, a per-token Python loop) stays off the engine's as well; unbound, it changes nothing."""
    try:
        pin_process(frozenset(os.sched_getaffinity(server_pid)))
    except OSError as error:
        log.warning("could not move to tritonserver's CPUs: %s", error)


def forget_server(pid: int) -> None:
    """Remove what stubs recorded about the exited server ``pid`` (one killed before its models unloaded)."""
    for record in Path(tempfile.gettempdir()).glob(f"{RECORD_PREFIX}{pid}-*.cpus"):
        record.unlink(missing_ok=True)


def _engine_cores_under(server_pid: int) -> int:
    """Engine core processes whose stub (their parent) is a child of ``server_pid``."""
    # Here, not at the top: the launcher imports this module and must not pull in torch and transformers.
    from pagedllm.engine.core_process import CHILD_MARKER

    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if CHILD_MARKER.encode() not in cmdline.read():
                    continue
            count += parent_pid(parent_pid(int(pid))) == server_pid
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return count
