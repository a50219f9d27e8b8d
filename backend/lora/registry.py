"""Adapters known to an engine: each ``lora_int_id``'s folder, and the loaded ones kept in host memory (LRU).

An id names one folder for the engine's life (it keys the prefix cache), so a second folder under a known id, or a
known name under another id, is refused. Adapters evicted from host memory are read again from their folder when a
slot needs them.
"""
from __future__ import annotations

from collections import OrderedDict

from pagedllm.lora.adapter import BaseModelShape, LoRAAdapter, load_adapter
from pagedllm.lora.request import LoRARequest


class AdapterRegistry:
    def __init__(self, shape: BaseModelShape, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.shape = shape
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._known: dict[int, LoRARequest] = {}
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_disk_loads = 0

    def add(self, request: LoRARequest) -> None:
        """Know ``request``'s adapter and hold it in host memory; ``ValueError`` naming what is wrong with it."""
        known = self._known.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
            raise ValueError(f"lora_int_id={request.lora_int_id} already names adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}; each id must name one adapter")
        for other in self._known.values():
            if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                raise ValueError(f"lora_name={request.lora_name!r} is already adapter {other.lora_int_id}")
        self._hold(request)
        self._known[request.lora_int_id] = request

    def get(self, lora_int_id: int) -> LoRAAdapter:
        """A known adapter's weights, read again from its folder if host memory let it go."""
        adapter = self._loaded.get(lora_int_id)
        if adapter is not None:
            self._loaded.move_to_end(lora_int_id)
            return adapter
        return self._hold(self._known[lora_int_id])

    def request_of(self, lora_int_id: int) -> LoRARequest:
        return self._known[lora_int_id]

    def _hold(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._loaded.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request.lora_name, request.lora_path, self.shape, self.max_lora_rank)
            self.num_disk_loads += 1
            self._loaded[request.lora_int_id] = adapter
            while len(self._loaded) > self.max_cpu_loras:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(request.lora_int_id)
        return adapter
