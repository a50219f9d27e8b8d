"""One all-reduce at a time, gloo against the shared-memory segment, in turns: the time per call of each.

``pagedllm bench tp --collectives`` starts two ranks of this module, joined as the
engine's ranks are (``join_group``), each bound to one CPU where the host has two.
They run blocks of calls of one kind, then of the other, in turns, so that a
busy spell of a shared host lands on both; rank 0 prints one JSON line with the
median time per call of each kind and size.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pagedllm.distributed.group import join_group, leave_group
from pagedllm.platform.cpu_binding import pin_process, place_ranks
from pagedllm.platform.processes import free_port

SHAPES = ((32, 512), (32, 4096), (512, 512))  # rows x hidden: decode steps of two widths, a prefill chunk
DTYPES = (torch.float32, torch.bfloat16)


def measure(rounds: int, calls: int) -> dict[str, float]:
    """Start the two ranks; rank 0's medians, microseconds per call, keyed ``kind dtype rows x hidden``."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-P", "-m", "pagedllm_bench.tp_collectives", str(rounds), str(calls)]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    out = [rank.communicate(timeout=600)[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise RuntimeError(f"the collectives benchmark's ranks exited with {[rank.returncode for rank in ranks]}")
    return json.loads(out[0].strip().splitlines()[-1])


def _rank(rounds: int, calls: int) -> None:
    rank = int(os.environ["RANK"])
    placement = place_ranks(os.sched_getaffinity(0), 2, {})
    if placement is not None:
        pin_process(placement[rank].cpus)
    torch.set_num_threads(1)
    tp = join_group(rank, 2, torch.device("cpu"))
    if tp.shm is None:
        raise RuntimeError("no shared-memory segment: nothing to compare gloo with")
    shm = tp.shm
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for dtype in DTYPES:
            for rows, hidden in SHAPES:
                x = torch.zeros(rows, hidden, dtype=dtype)  # sums stay finite however many calls
                for kind, call in (("gloo", lambda: dist.all_reduce(x)), ("shm", lambda: shm.all_reduce(x))):
                    key = f"{kind} {str(dtype).removeprefix('torch.')} {rows}x{hidden}"
                    times.setdefault(key, []).append(_per_call_us(call, calls))
    if rank == 0:
        print(json.dumps({key: statistics.median(values) for key, values in times.items()}), flush=True)
    leave_group()


def _per_call_us(call: Callable[[], object], calls: int) -> float:
    dist.barrier()  # both ranks start the block together
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e6


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]))
