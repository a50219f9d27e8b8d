"""Rank 0's side of tensor parallelism: start the worker ranks, hand them their work, notice when one dies.

Workers are plain child interpreters of the engine-core process, started with
the same Python (in a served model that is the venv's, not the Triton stub's),
one per rank 1..tp-1, each bound to its share of the CPUs on a CPU engine. Each joins torch.distributed's env rendezvous on a port
picked free here, loads its own slice of the checkpoint and then runs the
forward of every step rank 0 broadcasts (:mod:`pagedllm.executor.worker_main`).
They never outlive rank 0: each asks the kernel for SIGKILL when its parent
dies (``PR_SET_PDEATHSIG``) and watches its parent's pid besides.

A worker that dies makes rank 0's next collective fail at once (gloo sees the
closed connection, a shared-memory wait its pid gone); :meth:`WorkerGroup.check` then names the rank and how it
ended, and the engine raises :class:`WorkerDied`, which ends the engine core so
that the serving layer's recovery starts a fresh one with fresh workers.

An engine dropped without ``close()`` (``del llm`` in a notebook) still releases its
group: a ``weakref.finalize`` kills its workers and leaves torch.distributed's default
group once the group object is collected, and a new group first collects garbage so a
dropped one is released before the next takes its place. One still in use is reported
in one line instead of torch's "default process group twice".
"""
from __future__ import annotations

import logging
import os
import signal
import gc
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from transformers import AutoConfig

from pagedllm.core.errors import EngineBroken
from pagedllm.platform.cpu_binding import (RankPlacement, count_other_processes, numa_nodes, parse_cpu_list,
                                           pin_process, place_ranks)
from pagedllm.platform.processes import free_port
from pagedllm.layers.tensor_parallel import model_shape
from pagedllm.distributed.group import TensorParallel, join_group, leave_group
from pagedllm.distributed.sharding import shard_layout
from pagedllm.worker.step_wire import broadcast_stop

log = logging.getLogger(__name__)

WORKER_MARKER = "from pagedllm.executor.worker_main import main"  # in every worker's command line
THREADS_ENV = "PAGEDLLM_TP_THREADS"
DEVICE_ENV = "PAGEDLLM_TP_DEVICE"
PARENT_ENV = "PAGEDLLM_TP_PARENT"
CPUS_ENV = "PAGEDLLM_TP_CPUS"  # this rank's CPUs (a CPU list), where the ranks are bound
NODES_ENV = "PAGEDLLM_TP_NODES"  # the NUMA nodes of those CPUs, whose memory the rank prefers


class WorkerDied(EngineBroken):
    """A tensor-parallel worker rank ended; the engine cannot step without it and must be restarted."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What every rank loads, sent by rank 0 once the group has formed."""

    config: Any  # pagedllm.core.config.EngineConfig
    model_dir: str
    dtype: torch.dtype
    attention_backend: str  # a name attention_backend_named() takes


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """How every rank sizes its KV cache and input batch, decided on rank 0 after the ranks agreed a budget."""

    num_blocks: int
    max_model_len: int


class WorkerGroup:
    """Ranks 1..size-1 as child processes, and this process as rank 0 of their group."""

    def __init__(self, size: int, device: torch.device, cpu_bind: str = "auto") -> None:
        _check_group_is_free()
        self.size = size
        self.device = device
        placement = _placement(size, cpu_bind) if device.type == "cpu" else None
        threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else torch.get_num_threads()
        if placement is not None:
            threads = min(threads, *(len(rank.cpus) for rank in placement))
        torch.set_num_threads(threads)  # this rank's share too: the ranks run their forwards at the same time
        port = free_port()
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size),
               THREADS_ENV: str(threads), PARENT_ENV: str(os.getpid()),
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._processes: list[subprocess.Popen[bytes]] = []
        self._stepping = False  # the workers wait for steps (and so for the stop) once they have a RunnerSpec
        for rank in range(1, size):
            rank_device = _rank_device(device, rank)
            command = [sys.executable, "-c", f"{WORKER_MARKER}; main()"]
            where = {} if placement is None else {CPUS_ENV: _cpu_list(placement[rank].cpus),
                                                   NODES_ENV: _cpu_list(placement[rank].nodes)}
            self._processes.append(subprocess.Popen(
                command, env={**env, "RANK": str(rank), DEVICE_ENV: str(rank_device), **where}))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # Rank 0 is this process (an offline LLM's is the user's): its own CPUs come back when the group ends.
        unbound = frozenset(os.sched_getaffinity(0))
        if placement is not None:
            pin_process(placement[0].cpus)
        # Holds the processes, not self: it runs when this group is collected without close().
        self._release = weakref.finalize(self, _release, self._processes, unbound if placement else None)
        try:
            self.tp: TensorParallel = join_group(0, size, device)
        except BaseException:
            self._release()
            raise

    def send(self, item: Any) -> None:
        """Hand every worker one object (the load spec, then the runner spec)."""
        dist.broadcast_object_list([item], src=0)
        self._stepping = isinstance(item, RunnerSpec)

    def death(self, wait_s: float = 2.0) -> str | None:
        """How a worker ended, if one has (waiting briefly: its connection closes before it is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self._processes, start=1):
                code = process.poll()
                if code is not None:
                    return f"tensor-parallel worker rank {rank} (pid {process.pid}) {_exit_cause(code)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def check(self, error: BaseException) -> None:
        """Raise :class:`WorkerDied` naming the rank if ``error`` came from a worker that died."""
        cause = self.death()
        if cause is not None:
            raise WorkerDied(f"{cause}; the engine restarts with fresh workers") from error

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (politely, then by force) and leave the group.

        Only workers in their step loop are told to stop: one still loading waits in another collective,
        which a stop broadcast would not match (Ctrl-C during a load), so it is killed instead."""
        if self._stepping and all(process.poll() is None for process in self._processes):
            try:
                broadcast_stop(self.tp)
            except Exception:  # a worker is already gone: the others are killed below
                log.warning("could not tell the tensor-parallel workers to stop; killing them")
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._release()

    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]


def _release(processes: list[subprocess.Popen[bytes]], unbound: frozenset[int] | None) -> None:
    """Kill the workers still running, leave the group and give rank 0 back the CPUs it had before; once per
    group (a ``weakref.finalize``)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    leave_group()
    if unbound is not None:
        pin_process(unbound)


def _placement(size: int, cpu_bind: str) -> list[RankPlacement] | None:
    """Each CPU rank's CPUs and NUMA nodes, as ``cpu_bind`` allows: ``"off"`` binds nothing; ``"auto"`` splits
    this process's CPUs unless another engine's workers run on the host (both would take the same CPUs); a CPU
    list is split as given."""
    allowed = frozenset(os.sched_getaffinity(0))
    if cpu_bind == "off" or (cpu_bind == "auto" and count_other_processes(WORKER_MARKER)):
        return None
    if cpu_bind != "auto":
        allowed &= parse_cpu_list(cpu_bind)
    placement = place_ranks(allowed, size, numa_nodes())
    if placement is not None:
        log.info("tensor-parallel ranks bound to CPUs %s", [sorted(rank.cpus) for rank in placement])
    return placement


def _cpu_list(ids: frozenset[int]) -> str:
    return ",".join(map(str, sorted(ids)))


def _check_group_is_free() -> None:
    """One engine group per process: collect a dropped engine's, and name the fix when one is still open."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()  # an LLM dropped without close() releases its group when collected
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel LLM is still open in this process (torch.distributed's default group "
                           "is taken): call close() on it, or use `with LLM(...) as llm:`, before starting another")


def check_size(size: int, device: torch.device, model_dir: str) -> None:
    """``ValueError`` naming tensor_parallel_size when the model cannot be split that way or this machine
    cannot place that many ranks: checked before any worker starts."""
    shard_layout(model_shape(AutoConfig.from_pretrained(model_dir)), 0, size)
    if device.type == "cuda":
        first = device.index or 0
        available = torch.cuda.device_count()
        if first + size > available:
            raise ValueError(f"engine argument tensor_parallel_size={size} is invalid: it needs {size} CUDA devices "
                             f"from {device}, and this machine has {available}")


def _rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
