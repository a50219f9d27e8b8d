"""One engine's LoRA state: the adapters it knows, the device slots, and the model's adapted linears.

The scheduler asks ``admit`` while scanning the waiting queue (a request enters the batch only when its adapter
holds a slot); the runner calls ``apply_loads`` before a step's forward and reads ``slot_of`` when it builds the
step's grouping (:mod:`pagedllm.lora.mapping`).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from pagedllm.core.request import Request, Sample
from pagedllm.lora.adapted_model import AdaptedModel
from pagedllm.lora.adapter_files import base_model_shape
from pagedllm.lora.linear import LoRAContext
from pagedllm.lora.registry import AdapterRegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import AdapterSlots
from pagedllm.models import CausalLM


class LoRAManager:
    def __init__(self, model: CausalLM, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.registry = AdapterRegistry(base_model_shape(model.config.to_dict()), max_lora_rank, max_cpu_loras)
        self.slots = AdapterSlots(max_loras)
        self.adapted = AdaptedModel(model, max_loras, max_lora_rank)

    @property
    def context(self) -> LoRAContext:
        return self.adapted.context

    def add(self, request: LoRARequest) -> None:
        """Check and hold ``request``'s adapter; ``ValueError`` naming what is wrong with it."""
        self.registry.add(request)

    def admit(self, request: Request, running: Seq[Sample]) -> bool:
        return self.slots.admit(request, running)

    def slot_of(self, lora_int_id: int) -> int:
        return self.slots.slot_of(lora_int_id)

    def apply_loads(self) -> list[tuple[int, LoRARequest]]:
        """Copy the adapters assigned to slots since the last step into them; returns what went where (the other
        tensor-parallel ranks load the same, :meth:`load_into`)."""
        loads = []
        for slot, lora_int_id in self.slots.take_loads():
            self.adapted.load(slot, self.registry.get(lora_int_id))
            loads.append((slot, self.registry.request_of(lora_int_id)))
        return loads

    def load_into(self, slot: int, request: LoRARequest) -> None:
        """Another rank: hold ``request``'s adapter (this rank's share of it) in ``slot``, as rank 0 does."""
        self.registry.add(request)
        self.adapted.load(slot, self.registry.get(request.lora_int_id))
