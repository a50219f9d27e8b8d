"""What a request names when it wants an adapter: vLLM's ``LoRARequest``.

Torch-free: the scheduler's side (``core/``) and the serving side read it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT LoRA folder to run a request through.

    ``lora_int_id`` (a positive integer) is the adapter's identity inside an engine: it keys the adapter slots and
    the prefix cache, so one id must always name the same folder.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} is invalid: expected a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is invalid: expected an integer >= 1 "
                             "(0 is the base model)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} is invalid: expected a path to a PEFT adapter folder")
