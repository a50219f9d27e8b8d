"""Load a Hugging Face checkpoint directory into the native ``CausalLM``.

Reads the config with ``AutoConfig`` and the weights with ``safetensors``
(one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``),
straight into the target dtype and device: the model is built on the meta
device, so no throwaway random initialisation is ever allocated. Under tensor
parallelism each rank reads only its own rows of each tensor
(``safe_open(...).get_slice``), so its peak host memory is about its share of
the weights, not the whole checkpoint.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from pagedllm.attention.backends import AttentionBackend
from pagedllm.models.architectures import resolve_architecture
from pagedllm.platform.cpu_dtypes import warn_if_emulated
from pagedllm.layers.cpu_fused_ops import cpu_fused_ops
from pagedllm.layers.cpu_linear import pack_linears, packed_linear, packed_linear_choice
from pagedllm.models.llama import CausalLM
from pagedllm.layers.quantization import QuantizedWeights
from pagedllm.layers.tensor_parallel import TensorPart
from pagedllm.distributed.group import SINGLE, TensorParallel

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionBackend,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """Build the model for ``model_dir`` and fill it with the checkpoint's weights.

    Float32 linears on a CPU are packed for MKL or oneDNN (:mod:`pagedllm.layers.cpu_linear`), and its
    elementwise steps run fused (:mod:`pagedllm.layers.cpu_fused_ops`).
    Logs a warning when ``dtype`` is a half type this CPU only emulates (see
    :mod:`pagedllm.platform.cpu_dtypes`). Raises ``ValueError`` for an unsupported architecture, a directory without
    safetensors weights, a checkpoint whose tensors do not match the model
    (names of missing and unexpected tensors are listed), or a ``tp`` group the model cannot be split over.
    """
    model_dir = Path(model_dir)
    device = torch.device(device)
    warn_if_emulated(dtype, device)
    packing = packed_linear_choice(dtype, device)
    config = AutoConfig.from_pretrained(model_dir)
    traits = resolve_architecture(config)
    quantized = QuantizedWeights.of_checkpoint(config, dtype, device)  # None unless compressed-tensors
    with torch.device("meta"):
        model = CausalLM(config, traits, attention, device, cpu_fused_ops(dtype, device), tp)
    files = checkpoint_files(model_dir)
    sources = model.checkpoint_sources()
    wanted = {part.name for source in sources.values() for part in source.parts}
    if quantized is not None:
        quantized.plan(model, sources)  # which FP8 Linears stay in 8 bits for torch._scaled_mm
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="pt", device=str(device))) for path in files}
        location = {name: path for path, handle in handles.items() for name in handle.keys()}
        missing = sorted(name for name in wanted if (quantized.stored_name(name) if quantized else name) not in location)
        unexpected = sorted(name for name in location.keys() - wanted if not _ignorable(name, model.tie_word_embeddings)
                            and not (quantized is not None and quantized.is_auxiliary(name)))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {model_dir} does not match {traits.name}: "
                f"missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
                f"unexpected tensors {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
            )
        state = {
            param: _stacked(_concat(_read_part(handles, location, part, quantized) for part in source.parts).to(dtype),
                            source.stack)
            for param, source in sources.items()
        }
    expected_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    wrong = [f"{name}: {tuple(t.shape)} != {expected_shapes[name]}" for name, t in state.items()
             if tuple(t.shape) != expected_shapes[name]]
    if wrong:
        raise ValueError(f"checkpoint {model_dir} has tensors of the wrong shape: {wrong[:5]}")
    model.load_state_dict(state, strict=True, assign=True)
    if quantized is not None:
        quantized.install(model)
    del state  # so that packing frees each unpacked weight as it goes
    model.requires_grad_(False)
    if packing is not None:
        pack_linears(model, packing)
        if model.lm_head is None:
            # A tied head gets its own packed copy; the embedding keeps the weight (vLLM's CPU backend does the same).
            model.lm_head = packed_linear(model.model.embed_tokens.weight, None, packing)
    return model.eval()


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shard index's files, else the single file."""
    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(path) for path in files if not path.is_file()]
        if absent:
            raise ValueError(f"{index} lists shard files that do not exist: {absent}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"no {SINGLE_FILE} or {SHARD_INDEX} in {model_dir}; only safetensors checkpoints are supported")


def _read(handle: Any, part: TensorPart) -> torch.Tensor:
    """The part's tensor, or only its rows (zero-padded up to the rank's share) without reading the rest."""
    if part.rows is None:
        return handle.get_tensor(part.name)
    rows = part.rows
    tensor_slice = handle.get_slice(part.name)
    index: list[slice] = [slice(None)] * len(tensor_slice.get_shape())
    index[rows.dim] = slice(rows.start, rows.stop)
    tensor = tensor_slice[tuple(index)]
    if rows.size < rows.padded:
        pad = list(tensor.shape)
        pad[rows.dim] = rows.padded - rows.size
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=rows.dim)
    return tensor


def _read_part(handles: dict[Path, Any], location: dict[str, Path], part: TensorPart,
               quantized: QuantizedWeights | None) -> torch.Tensor:
    """:func:`_read`, or for a quantized checkpoint's quantized weight its dequantized rows
    (:mod:`pagedllm.layers.quantization`)."""
    if quantized is not None and quantized.quantizes(part.name):
        return quantized.load(part.name, part.rows,
                              lambda name: handles[location[name]].get_tensor(name) if name in location else None)
    return _read(handles[location[part.name]], part)


def _concat(tensors: Iterator[torch.Tensor]) -> torch.Tensor:
    parts = list(tensors)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _stacked(tensor: torch.Tensor, stack: int) -> torch.Tensor:
    return tensor if stack == 0 else tensor.view(stack, -1, *tensor.shape[1:])


def _ignorable(name: str, tied: bool) -> bool:
    # Old checkpoints store rotary tables we recompute; tied ones may still carry a copy of the head.
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")
