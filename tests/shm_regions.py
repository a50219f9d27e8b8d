"""The Python backend stubs' shared-memory regions in ``/dev/shm``, for tests that kill servers or stubs, and
the tensor-parallel ranks' segments (``pagedllm.distributed.shm_group``: unlinked once mapped, so never left).

A stub names its region on its command line; tritonserver removes it when it unloads the
model, so a server or stub killed instead leaves the region (1 MiB) behind. A region no
live process maps is an orphan: nothing can use it again.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "triton_pagedllm_backend_shm_region_"
PREFIXES = (PREFIX, "pagedllm_tp_")


def present() -> set[str]:
    """Our regions in ``/dev/shm`` now."""
    try:
        return {entry.name for entry in SHM.iterdir() if entry.name.startswith(PREFIXES)}
    except OSError:
        return set()


def mapped() -> set[str]:
    """Our regions some live process maps (its server or stub, this run's or another's)."""
    found: set[str] = set()
    markers = tuple(f"{SHM}/{prefix}" for prefix in PREFIXES)
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(marker in text for marker in markers):
            found.update(line.rsplit("/", 1)[-1] for line in text.splitlines()
                         if any(marker in line for marker in markers))
    return found


def orphans(before: Iterable[str] = ()) -> set[str]:
    """Our regions that appeared since ``before`` and that no live process maps."""
    return present() - set(before) - mapped()


def named_by(pids: Iterable[int]) -> set[str]:
    """The regions these processes (backend stubs) name on their command lines."""
    regions: set[str] = set()
    for pid in pids:
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        regions.update(a.decode() for a in arguments if a.startswith(PREFIX.encode()))
    return regions


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(parent, []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in parents.get(parent, [])]
        found += children
        frontier = children
    return found


def remove_unmapped(regions: Iterable[str], wait_s: float = 30.0) -> set[str]:
    """Unlink each region once no live process maps it (waiting up to ``wait_s`` for killed ones to go);
    returns those still mapped, which their living owner removes."""
    pending = set(regions)
    deadline = time.monotonic() + wait_s
    while True:
        pending &= present()
        for region in pending - mapped():
            (SHM / region).unlink(missing_ok=True)
        pending &= present()
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.2)


def kill_tree(process: subprocess.Popen[str]) -> None:
    """SIGKILL ``process`` and every process below it (tritonserver, its stubs, engine cores), then remove
    the regions the stubs named."""
    if process.poll() is not None:
        return
    tree = descendants(process.pid)
    regions = named_by(tree)
    for pid in [process.pid, *tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    remove_unmapped(regions)
