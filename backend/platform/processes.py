"""Process helpers, each written once: ``/proc/<pid>/stat`` fields, children, free ports, dying with a parent."""
from __future__ import annotations

import ctypes
import socket
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
# Resolved at import, not in a forked child: dlopen there could deadlock on a lock another thread held.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def stat_field(pid: int, number: int) -> str:
    """Field ``number`` (1-based, as in proc(5)) of ``/proc/<pid>/stat``; ``OSError`` once the process is gone.

    The fields are split after the command name (field 2), which may hold spaces and parentheses.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    try:
        return fields[number - 3]
    except IndexError:
        raise OSError(f"/proc/{pid}/stat has no field {number}") from None


def parent_pid(pid: int) -> int:
    return int(stat_field(pid, 4))


def start_time(pid: int) -> str:
    """With the pid, names one process for the life of the host."""
    return stat_field(pid, 22)


def cpu_ticks(pid: int) -> int:
    """User plus system time of all of the process's threads, in clock ticks."""
    return int(stat_field(pid, 14)) + int(stat_field(pid, 15))


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` has ended: a zombie, or gone."""
    try:
        return stat_field(pid, 3) == "Z"
    except OSError:
        return True


def exit_code_of_zombie(pid: int) -> int | None:
    """The wait status a zombie's ``/proc`` entry holds while it lasts (field 52, exit_code: Linux >= 3.5)."""
    try:
        return int(stat_field(pid, 52))
    except (OSError, ValueError):
        return None


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                if parent_pid(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError):
                continue
    return found


def free_port() -> int:
    """A TCP port on the loopback that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent(signum: int) -> None:
    """Ask the kernel for ``signum`` when this process's parent thread dies (Linux; elsewhere nothing)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signum)
