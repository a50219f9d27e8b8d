"""This process's place in the tensor-parallel group, and the collectives the forward calls.

The group is torch.distributed's default process group (gloo on CPU, NCCL on
CUDA), joined through its env rendezvous (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``). One engine per process, so the default group is
the engine's. CPU ranks on one host also share a memory segment, through which
the forward's all-reduces and the logits gather go instead of gloo's TCP pairs
(:mod:`pagedllm.distributed.shm_group`); gloo runs whatever that cannot. At
size 1 every collective is a no-op and nothing is imported or initialised, so
the single-device engine runs exactly as before.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.distributed.shm_group import SharedMemoryGroup, open_shared_memory

# A step's collectives wait at most this long for a peer (a long prefill on a slow rank takes seconds,
# a dead peer is noticed at once by gloo's closed connection and within 50 ms in shared memory; NCCL needs
# the bound).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=15)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``size == 1`` means no group at all."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where this rank's collective buffers live
    shm: SharedMemoryGroup | None = None  # CPU ranks on one host: the forward's collectives go through it

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks, in place."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.can_all_reduce(x):
            return self.shm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` side by side along the last dimension; the other ranks: ``None``."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and self.shm.can_gather(x):
            return self.shm.gather_columns(x)
        if not self.is_first:
            dist.gather(x, None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def broadcast_ints(self, values: torch.Tensor | None, patient: bool = False) -> torch.Tensor:
        """Rank 0 sends a 1-D int64 tensor whose length the others do not know; every rank returns it.

        ``patient``: a receiver waits for rank 0 however long it takes (a worker between steps) where the
        message goes through shared memory; a peer that ends still ends the wait."""
        if self.shm is not None:
            return self._broadcast_through_memory(self.shm, values, patient)
        length = torch.tensor([0 if values is None else values.numel()], dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=0)
        if values is None:
            values = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
        dist.broadcast(values, src=0)
        return values

    def _broadcast_through_memory(self, shm: SharedMemoryGroup, values: torch.Tensor | None,
                                  patient: bool) -> torch.Tensor:
        # The message's first int: 0 when the values follow inline, else their count, then sent by gloo.
        if self.is_first:
            if values is None:
                raise ValueError("rank 0 broadcasts values")
            inline = shm.can_broadcast((values.numel() + 1) * 8)
            count = torch.tensor([0 if inline else values.numel()], dtype=torch.int64)
            shm.broadcast_from_first(torch.cat([count, values.reshape(-1)]) if inline else count)
            if not inline:
                dist.broadcast(values, src=0)
            return values
        message = shm.broadcast_from_first(None, patient).view(torch.int64)
        if message[0] == 0:
            return message[1:]
        values = torch.empty(int(message[0]), dtype=torch.int64)
        dist.broadcast(values, src=0)
        return values

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (each rank's KV budget: the cache is as small as the least)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


SINGLE = TensorParallel()
_shared_memory: list[SharedMemoryGroup] = []  # this process's segment while it is in the group


def join_group(rank: int, size: int, device: torch.device) -> TensorParallel:
    """Join the default process group from the environment's rendezvous; blocks until every rank has."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **kwargs)
    shm = open_shared_memory(rank, size, COLLECTIVE_TIMEOUT.total_seconds()) if device.type == "cpu" else None
    if shm is not None:
        _shared_memory.append(shm)
    return TensorParallel(rank, size, device, shm)


def leave_group() -> None:
    while _shared_memory:
        _shared_memory.pop().close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
