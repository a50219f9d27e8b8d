"""All-reduce and gather through one shared-memory segment, for tensor-parallel CPU ranks on one host.

gloo moves every all-reduce through TCP pairs over loopback: tens of microseconds
of system calls and copies per call even for a few kilobytes, and a step makes two
per layer. Ranks on one host can instead meet in memory, as vLLM's CPU communicator
does: each rank copies its part into its own slot of a ``/dev/shm`` segment, raises
a flag, waits for the others' flags and reads their slots. Rank 0's broadcast of each
step's inputs goes the same way. The flags and the sums
are the C routines of ``shm_collectives.c`` (Python has no atomics); the segment,
its layout and every decision about when to use it are here.

torch.distributed's group stays the group: it forms the ranks, carries the set-up
(the segment's name, each rank's pid and host) and runs whatever this does not:
ranks on different hosts, dtypes other than float32 and bfloat16, a row wider
than a slot, or every collective when the C routines cannot be built
(``PAGEDLLM_TP_SHM=0`` turns this off). Larger tensors go through in slot-sized
chunks.

The segment is unlinked as soon as every rank has mapped it, so nothing is left
in ``/dev/shm`` however a rank ends afterwards; one left by a rank 0 killed during
the set-up itself is removed by the next set-up on the host (its name carries the
dead pid). A waiting rank spins for up to a millisecond, then sleeps on a futex, and
every 50 ms checks that its peers are alive: a peer that died ends the wait with
:class:`PeerGone`, which the engine turns into ``WorkerDied`` as it does gloo's
closed connection.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import secrets
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm.platform.native_build import load_library
from pagedllm.platform.processes import is_zombie

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("shm_collectives.c")
SWITCH_ENV = "PAGEDLLM_TP_SHM"  # "0": every collective goes through torch.distributed
SHM_DIR = Path("/dev/shm")
PREFIX = "pagedllm_tp_"  # then rank 0's pid and a random tag
SLOT_BYTES = 4 << 20  # per rank and round parity; a decode step's all-reduce is a few hundred KiB at most
SPIN_NS = 1_000_000  # a waiting rank spins this long (a step's ranks arrive within it), then sleeps on a futex
SLICE_NS = 50_000_000  # and checks its peers are alive this often
_DTYPES = (torch.float32, torch.bfloat16)


class PeerGone(RuntimeError):
    """A rank this one waited for in a shared-memory collective has ended."""


class SharedMemoryGroup:
    """This rank's view of the group's segment: the collectives, and the time spent in them."""

    def __init__(self, library: ctypes.CDLL, mapping: mmap.mmap, rank: int, world: int, pids: list[int],
                 timeout_s: float) -> None:
        self.rank, self.world, self._pids, self._timeout_s = rank, world, pids, timeout_s
        self._mapping = mapping
        self._anchor = ctypes.c_char.from_buffer(mapping)  # holds the address; released before unmapping
        base = ctypes.addressof(self._anchor)
        self._controls = base
        data = base + _data_offset(world, _control_bytes(library))
        self._slots = [[data + (r * 2 + parity) * SLOT_BYTES for r in range(world)] for parity in (0, 1)]
        self._slot_arrays = [(ctypes.c_void_p * world)(*self._slots[parity]) for parity in (0, 1)]
        self._post, self._wait_c = library.pagedllm_shm_post, library.pagedllm_shm_wait
        self._sum = {torch.float32: library.pagedllm_shm_sum_f32, torch.bfloat16: library.pagedllm_shm_sum_bf16}
        self._gather = library.pagedllm_shm_gather_rows
        self._posted_bytes = library.pagedllm_shm_posted_bytes
        self._round = 0
        self._broken: str | None = None
        self.calls = 0
        self.seconds = 0.0  # inside the collectives, waiting for peers included

    def can_all_reduce(self, x: torch.Tensor) -> bool:
        return x.dtype in _DTYPES and x.device.type == "cpu" and x.is_contiguous()

    def can_broadcast(self, nbytes: int) -> bool:
        return nbytes <= SLOT_BYTES

    def can_gather(self, x: torch.Tensor) -> bool:
        return self.can_all_reduce(x) and x.dim() >= 1 and 0 < x.shape[-1] * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks, in place; float32 or bfloat16 (summed in float32)."""
        started = time.perf_counter()
        size = x.element_size()
        chunk = SLOT_BYTES // size
        address, count = x.data_ptr(), x.numel()
        for first in range(0, count, chunk):
            n = min(chunk, count - first)
            at = address + first * size
            parity = self._exchange(at, n * size, "all-reduce")
            self._sum[x.dtype](ctypes.c_void_p(at), self._slot_arrays[parity], self.world, ctypes.c_int64(n),
                               torch.get_num_threads())
        self._account(started)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` side by side along the last dimension; the other ranks: ``None``."""
        started = time.perf_counter()
        row_bytes = x.shape[-1] * x.element_size()
        rows = x.numel() // x.shape[-1]
        out = (torch.empty(*x.shape[:-1], self.world * x.shape[-1], dtype=x.dtype) if self.rank == 0 else None)
        per_round = SLOT_BYTES // row_bytes
        for first in range(0, rows, per_round):
            n = min(per_round, rows - first)
            parity = self._exchange(x.data_ptr() + first * row_bytes, n * row_bytes, "gather")
            if out is not None:  # the others wait too: that is what keeps a slot from being reused too early
                self._gather(ctypes.c_void_p(out.data_ptr() + first * self.world * row_bytes),
                             self._slot_arrays[parity], self.world, ctypes.c_int64(n), ctypes.c_int64(row_bytes))
        self._account(started)
        return out

    def broadcast_from_first(self, message: torch.Tensor | None, patient: bool = False) -> torch.Tensor:
        """Rank 0 sends ``message`` (dense, at most a slot); every other rank returns a copy of it as ``uint8``.
        ``patient``: wait for rank 0 without the time limit (a worker waiting for the next step, however long
        the engine stays idle); a peer that ends still ends the wait."""
        started = time.perf_counter()
        if self.rank == 0:
            if message is None or message.nbytes > SLOT_BYTES or not message.is_contiguous():
                raise ValueError("rank 0 broadcasts one dense tensor of at most a slot")
            self._exchange(message.data_ptr(), message.nbytes, "broadcast", check_size=False)
            self._account(started)
            return message.view(torch.uint8).reshape(-1)
        parity = self._exchange(0, 0, "broadcast", check_size=False, patient=patient)
        nbytes = int(self._posted_bytes(ctypes.c_void_p(self._controls), 0, ctypes.c_uint64(self._round)))
        received = torch.empty(nbytes, dtype=torch.uint8)
        ctypes.memmove(received.data_ptr(), self._slots[parity][0], nbytes)
        self._account(started)
        return received

    def close(self) -> None:
        """Unmap the segment (its name was unlinked at set-up)."""
        if self._mapping.closed:
            return
        self._broken = "the process left the group"
        self._slot_arrays.clear()
        del self._anchor
        self._mapping.close()

    def _exchange(self, address: int, nbytes: int, what: str, check_size: bool = True, patient: bool = False) -> int:
        """Post ``nbytes`` at ``address`` as this rank's part of the next round and wait for every rank's;
        returns the round's slot parity. ``check_size``: every rank must post as many bytes."""
        if self._broken is not None:
            raise RuntimeError(f"the shared-memory collectives of rank {self.rank} stopped earlier: {self._broken}")
        self._round += 1
        parity = self._round & 1
        self._post(ctypes.c_void_p(self._controls), self.rank, ctypes.c_uint64(self._round),
                   ctypes.c_void_p(self._slots[parity][self.rank]), ctypes.c_void_p(address), ctypes.c_int64(nbytes))
        expected = nbytes if check_size else -1
        code = self._wait(expected, SPIN_NS)
        deadline = time.monotonic() + self._timeout_s
        while code == 1:  # a peer is late: alive? then wait on (Ctrl-C is seen between slices)
            self._check_peers(what)
            if not patient and time.monotonic() > deadline:
                self._fail(f"rank {self.rank} waited {self._timeout_s:.0f} s for its peers in a shared-memory "
                           f"{what} (round {self._round}); a peer is alive but not arriving", RuntimeError)
            code = self._wait(expected, 0)
        if code < 0:
            self._fail(f"rank {-1 - code} posted a different size than rank {self.rank}'s {nbytes} bytes in a "
                       f"shared-memory {what}: the ranks ran different collectives", RuntimeError)
        return parity

    def _wait(self, nbytes: int, spin_ns: int) -> int:
        return int(self._wait_c(ctypes.c_void_p(self._controls), self.world, ctypes.c_uint64(self._round),
                                ctypes.c_int64(nbytes), ctypes.c_int64(spin_ns), ctypes.c_int64(SLICE_NS)))

    def _check_peers(self, what: str) -> None:
        for rank, pid in enumerate(self._pids):
            if rank != self.rank and is_zombie(pid):
                self._fail(f"tensor-parallel rank {rank} (pid {pid}) ended while rank {self.rank} waited for it "
                           f"in a shared-memory {what}", PeerGone)

    def _fail(self, message: str, kind: type[RuntimeError]) -> None:
        self._broken = message
        raise kind(message)

    def _account(self, started: float) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - started


def open_shared_memory(rank: int, world: int, timeout_s: float) -> SharedMemoryGroup | None:
    """Every rank of the default group calls this once after joining it; each gets its view of one new
    segment, or ``None`` on every rank (then torch.distributed runs every collective) when any rank cannot
    use one: another host, no C compiler, no room in ``/dev/shm``."""
    library = None if os.environ.get(SWITCH_ENV) == "0" else _library()  # read each time: a bench flips it
    mine = (_host_id(), library is not None, os.getpid())
    everyone: list[tuple[str, bool, int] | None] = [None] * world
    dist.all_gather_object(everyone, mine)
    if library is None or any(other is None or other[0] != mine[0] or not other[1] for other in everyone):
        log.info("tensor-parallel collectives go through torch.distributed: the ranks are not all on this host "
                 "or cannot all build %s", SOURCE.name)
        return None
    pids = [other[2] for other in everyone]  # type: ignore[index]
    size = _data_offset(world, _control_bytes(library)) + world * 2 * SLOT_BYTES
    name: str | None = None
    mapping: mmap.mmap | None = None
    try:
        if rank == 0:
            name, mapping = _create(size)
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
        if name is None:
            return None
        if rank != 0:
            mapping = _open(name, size)
        ready = torch.tensor([int(mapping is not None)], dtype=torch.int64)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    finally:
        if rank == 0 and name is not None:
            (SHM_DIR / name).unlink(missing_ok=True)  # every rank has it mapped (or gave up): the name can go
    if not int(ready.item()) or mapping is None:
        if mapping is not None:
            mapping.close()
        return None
    return SharedMemoryGroup(library, mapping, rank, world, pids, timeout_s)


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = load_library(SOURCE, SWITCH_ENV, "tensor-parallel collectives go through torch.distributed", log)
    if library is None:
        return None
    pointer, i64, u64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int
    library.pagedllm_shm_control_bytes.restype = i64
    library.pagedllm_shm_post.argtypes = [pointer, i32, u64, pointer, pointer, i64]
    library.pagedllm_shm_post.restype = None
    library.pagedllm_shm_wait.argtypes = [pointer, i32, u64, i64, i64, i64]
    library.pagedllm_shm_wait.restype = i32
    for routine in (library.pagedllm_shm_sum_f32, library.pagedllm_shm_sum_bf16):
        routine.argtypes = [pointer, pointer, i32, i64, i32]
        routine.restype = None
    library.pagedllm_shm_posted_bytes.argtypes = [pointer, i32, u64]
    library.pagedllm_shm_posted_bytes.restype = i64
    library.pagedllm_shm_gather_rows.argtypes = [pointer, pointer, i32, i64, i64]
    library.pagedllm_shm_gather_rows.restype = None
    return library


def _control_bytes(library: ctypes.CDLL) -> int:
    return int(library.pagedllm_shm_control_bytes())


def _data_offset(world: int, control_bytes: int) -> int:
    return -(-world * control_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _host_id() -> str:
    """Equal on two processes of one running kernel and host name."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _create(size: int) -> tuple[str | None, mmap.mmap | None]:
    """A new zeroed segment of ``size`` bytes, its pages reserved now (a full ``/dev/shm`` fails here, not with
    SIGBUS mid-step); ``(None, None)`` with a warning when that is not possible."""
    _remove_orphans()
    name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
    path = SHM_DIR / name
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        log.warning("cannot create %s (%s): tensor-parallel collectives go through torch.distributed", path, error)
        return None, None
    try:
        os.posix_fallocate(descriptor, 0, size)
        return name, mmap.mmap(descriptor, size)
    except OSError as error:
        path.unlink(missing_ok=True)
        log.warning("cannot reserve %d MiB in %s (%s): tensor-parallel collectives go through torch.distributed",
                    size >> 20, SHM_DIR, error)
        return None, None
    finally:
        os.close(descriptor)


def _open(name: str, size: int) -> mmap.mmap | None:
    path = SHM_DIR / name
    try:
        descriptor = os.open(path, os.O_RDWR)
    except OSError as error:  # another /dev/shm (a separate container on the same kernel)
        log.warning("cannot open rank 0's %s (%s): tensor-parallel collectives go through torch.distributed",
                    path, error)
        return None
    try:
        if os.fstat(descriptor).st_size != size:
            log.warning("%s is not the %d bytes rank 0 made: tensor-parallel collectives go through "
                        "torch.distributed", path, size)
            return None
        return mmap.mmap(descriptor, size)
    finally:
        os.close(descriptor)


def _remove_orphans() -> None:
    """Unlink segments whose rank 0 died during a set-up (named after its pid, now gone)."""
    try:
        entries = [entry for entry in SHM_DIR.iterdir() if entry.name.startswith(PREFIX)]
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(PREFIX):].split("_", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            entry.unlink(missing_ok=True)
