"""The shared-memory collectives of CPU tensor-parallel ranks: torch's results at odd sizes in float32 and
bfloat16, gloo behind what they do not take, a dead peer named in one clear error, nothing left in /dev/shm.

Each case runs two real ranks (child processes joined through torch.distributed's env rendezvous, as the
engine's workers are) through ``join_group``, the code path the forward uses. Greedy tokens at TP=2 over
shared memory against TP=1 and transformers are in ``test_tensor_parallel.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.distributed.shm_group import PREFIX, SHM_DIR, SLOT_BYTES
from pagedllm.platform.cpu_binding import RankPlacement, place_ranks
from pagedllm.platform.processes import free_port

_PRELUDE = """
import os, sys, torch
import torch.distributed as dist
from pagedllm.distributed.group import join_group, leave_group
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
tp = join_group(rank, 2, torch.device("cpu"))
print("shm", tp.shm is not None, flush=True)
g = torch.Generator().manual_seed(rank)
"""

_COLLECTIVES = """
def check(what, got, want):
    if not torch.equal(got, want):
        sys.exit(f"{what}: largest difference {(got.double() - want.double()).abs().max().item()}")

for dtype in (torch.float32, torch.bfloat16):
    slot = SLOT_BYTES // torch.finfo(dtype).bits * 8
    for n in (1, 7, 4099, slot + 3, 2 * slot + 1):  # the last two take two and three rounds
        x = torch.randn(n, generator=g).to(dtype)
        want = x.to(torch.float32, copy=True)
        dist.all_reduce(want)  # gloo, in float32: the shared-memory sum of bfloat16 is float32 rounded once
        check(f"all_reduce {dtype} {n}", tp.all_reduce(x.clone()), want.to(dtype))
    for rows, cols in ((1, 1), (5, 1027), (slot // 1000 + 7, 1000)):  # the last takes two rounds
        x = torch.randn(rows, cols, generator=g).to(dtype)
        got = tp.gather_columns(x)
        parts = [torch.empty_like(x) for _ in range(2)] if rank == 0 else None
        dist.gather(x, parts, dst=0)
        if rank == 0:
            check(f"gather {dtype} {rows}x{cols}", got, torch.cat(parts, -1))
        elif got is not None:
            sys.exit("rank 1 got a gathered tensor")
# Through gloo: a dtype the segment does not take, and a row wider than a slot.
x = torch.arange(5, dtype=torch.float64) * (rank + 1)
check("all_reduce float64", tp.all_reduce(x), torch.arange(5, dtype=torch.float64) * 3)
wide = torch.full((1, SLOT_BYTES // 4 + 1), float(rank))
got = tp.gather_columns(wide)
if rank == 0:
    check("wide gather", got, torch.cat([torch.zeros_like(wide), torch.ones_like(wide)], -1))
calls = tp.shm.calls if tp.shm is not None else 0
print("shm calls", calls, flush=True)
leave_group()
"""


def _run_ranks(script: str, tmp_path: Path, env: dict[str, str] | None = None,
               timeout_s: float = 240) -> list[subprocess.CompletedProcess[str]]:
    source = tmp_path / "ranks.py"
    source.write_text(textwrap.dedent(f"SLOT_BYTES = {SLOT_BYTES}\n") + _PRELUDE + textwrap.dedent(script))
    common = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-P", str(source)], env={**common, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    done = []
    try:
        for rank in ranks:
            out, err = rank.communicate(timeout=timeout_s)
            done.append(subprocess.CompletedProcess(rank.args, rank.returncode, out, err))
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    return done


def _segments() -> set[str]:
    return {entry.name for entry in SHM_DIR.iterdir() if entry.name.startswith(PREFIX)}


def test_collectives_equal_torch_at_odd_sizes_in_float32_and_bfloat16(tmp_path: Path) -> None:
    before = _segments()
    # A segment whose rank 0 was killed during its set-up (named after a pid now gone): the next set-up removes it.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = SHM_DIR / f"{PREFIX}{gone.pid}_deadbeef"
    orphan.write_bytes(b"\0" * 4096)
    try:
        for result in _run_ranks(_COLLECTIVES, tmp_path):
            assert result.returncode == 0, result.stderr[-3000:]
            assert "shm True" in result.stdout
            assert int(result.stdout.split("shm calls")[1]) == 2 * (5 + 3)  # two dtypes; the gloo ones not counted
        assert not orphan.exists()
    finally:
        orphan.unlink(missing_ok=True)
    assert _segments() <= before


@pytest.mark.full
def test_switched_off_every_collective_goes_through_gloo(tmp_path: Path) -> None:
    for result in _run_ranks(_COLLECTIVES, tmp_path, env={"PAGEDLLM_TP_SHM": "0"}):
        assert result.returncode == 0, result.stderr[-3000:]
        assert "shm False" in result.stdout


def test_a_peer_that_dies_ends_the_wait_with_an_error_naming_it(tmp_path: Path) -> None:
    before = _segments()
    rank0, rank1 = _run_ranks("""
        from pagedllm.distributed.shm_group import PeerGone
        x = torch.ones(1000)
        tp.all_reduce(x)
        if rank == 1:
            print("pid", os.getpid(), flush=True)
            os._exit(3)  # no goodbye: as a killed worker
        try:
            tp.all_reduce(x)
        except PeerGone as error:
            print("error:", error, flush=True)
            try:
                tp.all_reduce(x)
            except RuntimeError as again:
                print("again:", again, flush=True)
    """, tmp_path)
    assert rank1.returncode == 3
    assert rank0.returncode == 0, rank0.stderr[-3000:]
    pid = int(rank1.stdout.split("pid")[1])
    assert (f"error: tensor-parallel rank 1 (pid {pid}) ended while rank 0 waited for it in a shared-memory "
            "all-reduce") in rank0.stdout
    assert "again: the shared-memory collectives of rank 0 stopped earlier" in rank0.stdout
    assert _segments() <= before


def test_ranks_take_a_numa_node_each_where_there_are_enough_else_equal_shares_of_cpus() -> None:
    two_nodes = {0: frozenset(range(4)), 1: frozenset(range(4, 8))}
    assert place_ranks(range(8), 2, two_nodes) == [RankPlacement(cpus=frozenset(range(4)), nodes=frozenset({0})),
                                                   RankPlacement(cpus=frozenset(range(4, 8)), nodes=frozenset({1}))]
    # Four nodes, two ranks: two whole nodes each; only the allowed CPUs of a node count.
    four = {n: frozenset({2 * n, 2 * n + 1}) for n in range(4)}
    assert place_ranks({0, 1, 2, 4, 6, 7}, 2, four) == [
        RankPlacement(cpus=frozenset({0, 1, 2}), nodes=frozenset({0, 1})),
        RankPlacement(cpus=frozenset({4, 6, 7}), nodes=frozenset({2, 3}))]
    # One node (or none known): consecutive equal shares, the node named where known.
    assert place_ranks({3, 5, 6, 9}, 2, {0: frozenset(range(16))}) == [
        RankPlacement(cpus=frozenset({3, 5}), nodes=frozenset({0})),
        RankPlacement(cpus=frozenset({6, 9}), nodes=frozenset({0}))]
    assert place_ranks({0, 1, 2}, 2, {}) == [RankPlacement(cpus=frozenset({0}), nodes=frozenset()),
                                            RankPlacement(cpus=frozenset({1, 2}), nodes=frozenset())]
    assert place_ranks({5}, 2, two_nodes) is None  # fewer CPUs than ranks: nothing is bound
