"""Which CPUs the engine core process computes on, and which are left to the serving side.

Served with ``engine_process`` (the default), the engine child shares the machine with
the Triton stub's threads (receiving requests, building and sending responses),
tritonserver's gRPC/HTTP threads and often the load itself. Those threads wake up for
every streamed token; left to the kernel's scheduler they land on the engine's cores
and stall its step mid-GEMM. So the engine child binds CPUs of its own, the stub moves
its threads to the rest, and so does tritonserver (:mod:`pagedllm.serving.server_placement`);
docs/results/RESULTS.md, "Serving", has the side-by-side ``--cpu-bind off`` / ``auto`` runs
of ``pagedllm bench serving``. vLLM's CPU backend binds its OpenMP threads for the same
reason (``VLLM_CPU_OMP_THREADS_BIND``, with CPUs reserved for the frontend).

``cpu_bind`` (an engine argument) is one of:

- ``"auto"`` (default): if the engine's torch thread count leaves at least one of the
  allowed CPUs free, the engine takes the last ``threads`` of them and the serving side
  the rest; otherwise nothing is bound (binding N threads to N of N CPUs gains nothing).
  Nor is anything bound while another pagedllm engine core runs on the host (several
  models or instances): each would pick the same last CPUs. Of two engines starting
  together at least the later one sees the other, so they never share bound CPUs; give
  each its own CPU list to bind them all.
- ``"off"``: nothing is bound.
- a CPU list such as ``"1"`` or ``"2-7,10"``: the engine takes exactly these CPUs, with
  one torch thread per CPU, and the serving side the remaining allowed CPUs (if any).

"Allowed" is the stub's affinity when it first started the engine, so a restarted child
gets the same split rather than the serving side's share.

Tensor-parallel CPU ranks split the engine's CPUs between them (:func:`place_ranks`):
a NUMA node each where the host has as many, each rank's new memory preferring its
node, so that a rank's weights and KV cache sit beside the cores that read them.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MODES = ("auto", "off")
MAX_CPUS = 8192  # Linux's largest NR_CPUS: a list past it is a typo, and "0-10**12" must not build a huge set


@dataclass(frozen=True, slots=True)
class CpuSplit:
    engine: frozenset[int]
    serving: frozenset[int]  # empty: the engine was given every allowed CPU, nothing is reserved
    explicit: bool  # from a CPU list: the engine runs one torch thread per CPU of ``engine``


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0,2-4"`` -> {0, 2, 3, 4}; ``ValueError`` for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list such as '1' or '2-7,10'")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{text!r} has a descending range {part.strip()!r}")
        if high >= MAX_CPUS:
            raise ValueError(f"{text!r} names CPU {high}; CPU ids are below {MAX_CPUS}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def check_setting(setting: str) -> None:
    """``ValueError`` unless ``setting`` is a mode or a well-formed CPU list."""
    if setting not in MODES:
        parse_cpu_list(setting)


def split_cpus(setting: str, allowed: Iterable[int], engine_threads: int,
               other_engines: int = 0) -> CpuSplit | None:
    """The split ``setting`` asks for among ``allowed`` CPUs, or ``None`` where nothing is bound."""
    allowed = frozenset(allowed)
    if setting == "off":
        return None
    if setting == "auto":
        if engine_threads >= len(allowed) or other_engines:
            return None
        engine = frozenset(sorted(allowed)[-engine_threads:])
        return CpuSplit(engine, allowed - engine, explicit=False)
    engine = parse_cpu_list(setting)
    outside = engine - allowed
    if outside:
        raise ValueError(f"engine argument cpu_bind={setting!r} names CPUs {sorted(outside)} outside the ones "
                         f"this process may run on: {sorted(allowed)}")
    return CpuSplit(engine, allowed - engine, explicit=True)


def pin_process(cpus: frozenset[int], pid: int | None = None) -> None:
    """Restrict every thread of process ``pid`` (default: this one) to ``cpus``; threads it starts
    later inherit it."""
    # sched_setaffinity(pid) covers only that thread; the others are named by their task ids.
    for task in os.listdir(f"/proc/{pid or 'self'}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def count_other_processes(marker: str) -> int:
    """Processes other than this one whose command line contains ``marker``."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                count += marker.encode() in cmdline.read()
        except OSError:  # gone, or not ours to read
            continue
    return count


def bind_engine(setting: str, allowed: frozenset[int], marker: str, threads: int) -> CpuSplit | None:
    """In the engine child, before the engine is built: pin this process to its share of the CPUs.

    ``marker``: what every engine child's command line contains, to see other engines. ``threads``: the
    size of torch's thread pool now; the caller resizes it to ``len(split.engine)`` when ``split.explicit``.
    """
    others = count_other_processes(marker) if setting == "auto" else 0
    split = split_cpus(setting, allowed, threads, others)
    if split is None and others:
        log.info("cpu_bind=auto: %d other pagedllm engine core(s) run on this host, so nothing is bound; "
                 "give each engine its own cpu_bind CPU list to bind them", others)
    # Unbound, the child still resets to every allowed CPU: it inherits the stub's affinity,
    # which is the serving side's share once an earlier child was bound.
    cpus = allowed if split is None else split.engine
    try:
        pin_process(cpus)
    except OSError as error:  # e.g. a container whose cpuset changed under us: run as we are, say so
        log.warning("could not bind the engine core to CPUs %s (%s); it runs unbound", sorted(cpus), error)
        return None
    if split is not None:
        log.info("engine core bound to CPUs %s; serving side: %s", sorted(split.engine),
                 sorted(split.serving) or "unbound")
    return split


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """One tensor-parallel rank's CPUs, and the NUMA nodes they sit on (empty where the host says nothing)."""

    cpus: frozenset[int]
    nodes: frozenset[int]


def numa_nodes() -> dict[int, frozenset[int]]:
    """The host's NUMA nodes and their CPUs, from sysfs; empty where it has none to say."""
    found: dict[int, frozenset[int]] = {}
    for entry in Path("/sys/devices/system/node").glob("node[0-9]*"):
        try:
            text = (entry / "cpulist").read_text().strip()
        except OSError:
            continue
        if text:
            found[int(entry.name[4:])] = parse_cpu_list(text)
    return found


def place_ranks(allowed: Iterable[int], size: int, nodes: dict[int, frozenset[int]]) -> list[RankPlacement] | None:
    """Each of ``size`` ranks' CPUs among ``allowed``: whole NUMA nodes per rank where there are at least as many
    nodes as ranks (a rank's weights, cache and threads then stay on one socket), else an equal share of
    consecutive CPUs; ``None`` when there are fewer CPUs than ranks."""
    allowed = frozenset(allowed)
    if len(allowed) < size:
        return None
    populated = [(node, cpus & allowed) for node, cpus in sorted(nodes.items()) if cpus & allowed]
    if len(populated) >= size:
        groups = [populated[len(populated) * r // size:len(populated) * (r + 1) // size] for r in range(size)]
        return [RankPlacement(cpus=frozenset().union(*(cpus for _, cpus in group)),
                              nodes=frozenset(node for node, _ in group)) for group in groups]
    ordered = sorted(allowed)
    shares = [frozenset(ordered[len(ordered) * r // size:len(ordered) * (r + 1) // size]) for r in range(size)]
    return [RankPlacement(cpus=share, nodes=frozenset(node for node, cpus in populated if cpus & share))
            for share in shares]


_MPOL_PREFERRED = 1
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}  # the syscall's number, per architecture


def prefer_memory_of(nodes: frozenset[int]) -> None:
    """Ask the kernel to place this process's new pages on ``nodes``' one node, falling back to others when it is
    full (``MPOL_PREFERRED``: a full node slows a rank down rather than having it killed). Only on hosts with more
    than one node; a kernel or architecture that refuses is logged and changes nothing."""
    number = _SET_MEMPOLICY.get(platform.machine())
    if len(nodes) != 1 or len(numa_nodes()) < 2 or number is None:
        return
    (node,) = nodes
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, _MPOL_PREFERRED, mask, ctypes.c_ulong(len(mask) * 64 + 1)) != 0:
        log.warning("could not prefer NUMA node %d's memory: %s", node, os.strerror(ctypes.get_errno()))
