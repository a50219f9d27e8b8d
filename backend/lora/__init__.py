"""Multi-LoRA serving: PEFT adapters over one base model, batched per step by adapter slot."""
from __future__ import annotations

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
