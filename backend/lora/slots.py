"""The device's adapter slots: which adapter each holds, assigned at admission, evicted least-recently-used.

Torch-free, so the scheduler can ask it (``admit``) while it scans the waiting queue. An adapter that a running
sequence uses is pinned; any other may give its slot to a newcomer. A slot assigned this step is queued as a
load (``take_loads``) that the runner copies in before the forward.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from pagedllm.core.request import Request, Sample

BASE_SLOT = -1  # tokens of the base model: no adapter


class AdapterSlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras={max_loras!r} is invalid: expected >= 1")
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._free = list(range(max_loras - 1, -1, -1))
        self._loads: list[tuple[int, int]] = []
        self.num_loads = 0
        self.num_evictions = 0

    def admit(self, request: Request, running: Seq[Sample]) -> bool:
        """Whether ``request``'s adapter holds a slot this step, assigning one when a slot can be had."""
        lora_id = request.lora_int_id
        if lora_id == 0:
            return True
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            return True
        if self._free:
            slot = self._free.pop()
        else:
            pinned = {seq.request.lora_int_id for seq in running}
            victim = next((held for held in self._slot_of if held not in pinned), None)
            if victim is None:
                return False
            slot = self._slot_of.pop(victim)
            self.num_evictions += 1
        self._slot_of[lora_id] = slot
        self._loads.append((slot, lora_id))
        self.num_loads += 1
        return True

    def slot_of(self, lora_int_id: int) -> int:
        """The slot of a resident adapter; :data:`BASE_SLOT` for the base model."""
        if lora_int_id == 0:
            return BASE_SLOT
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            raise RuntimeError(f"adapter {lora_int_id} is scheduled but holds no slot")
        return slot

    def take_loads(self) -> list[tuple[int, int]]:
        """(slot, lora_int_id) assignments since the last call, in order; a later one for a slot wins."""
        loads, self._loads = self._loads, []
        return loads

    @property
    def resident(self) -> dict[int, int]:
        return dict(self._slot_of)
