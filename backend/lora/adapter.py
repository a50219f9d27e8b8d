"""A checked PEFT LoRA adapter loaded into host memory, as the engine applies it (see ``adapter_files``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.lora.adapter_files import WEIGHTS_FILE, BaseModelShape, check_adapter


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapted linear: ``A`` [rank, in] and ``B`` [out, rank], as PEFT stores them."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A checked adapter in host memory: ``weights[(layer, module)]``, applied as ``y += scale * x A^T B^T``."""

    name: str
    path: str
    rank: int
    scale: float
    base_model_name_or_path: str | None
    weights: dict[tuple[int, str], LoRAWeights]

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)


def load_adapter(name: str, path: str | Path, shape: BaseModelShape, max_lora_rank: int) -> LoRAAdapter:
    """The adapter in ``path``, checked against ``shape`` and ``max_lora_rank`` (``ValueError`` naming the
    problem), with its weights in float32."""
    files = check_adapter(name, path, shape, max_lora_rank)
    try:
        with safe_open(str(files.weights_file), framework="pt", device="cpu") as handle:
            weights = {where: LoRAWeights(handle.get_tensor(a).float(), handle.get_tensor(b).float())
                       for where, (a, b) in files.tensors.items()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is corrupt or unreadable ({error})") from error
    return LoRAAdapter(name=files.name, path=files.path, rank=files.rank, scale=files.scale,
                       base_model_name_or_path=files.base_model_name_or_path, weights=weights)
