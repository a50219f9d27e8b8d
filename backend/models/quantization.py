"""Quantized checkpoints in the compressed-tensors format: what they hold, checked, and turned into weights.

A checkpoint that llm-compressor (or ``compressed-tensors`` itself) wrote carries a
``quantization_config`` in its config.json with ``quant_method: compressed-tensors``.
Its schema is compressed-tensors' own ``QuantizationConfig``; this module parses it with
that class, accepts what the engine can run and refuses the rest by name:

* weights of the targeted ``Linear`` layers in 8 bits: FP8 (``float``, e4m3) or INT8
  (``int``, symmetric), with one scale per tensor or per output channel (``weight_scale``),
  stored as they are (``float-quantized``, ``int-quantized``, ``naive-quantized``) or INT8
  packed into int32 words (``pack-quantized``, what llm-compressor writes for W8A16);
* input activations: none (weight-only), or FP8 with a static (``input_scale``) or dynamic scale;
* a KV-cache scheme: per-layer ``k_scale`` / ``v_scale`` for an 8-bit KV cache.

Weights are dequantized once at load into the compute dtype (:class:`QuantizedWeights`), with one
log line saying so. Activation quantization is not emulated: with dequantized weights the
forward runs in the compute dtype, as vLLM does on hardware without FP8 support; a static
``input_scale`` is still checked, so a corrupt one fails the load.

On a CPU, torch's int8 weight-packed matmul (``aten._weight_int8pack_mm``) was measured
against dequantizing once (``scripts/ab_int8_weight_matmul.py``, 1 thread, 2048x2048, this
project's AVX-512 host): with float32 activations, the engine's CPU default, it is 5-35x slower
than the packed float32 GEMM (5.4 ms vs 1.1 ms at 1 row, 39 ms vs 2.2 ms at 8); with bfloat16
activations it wins only at one row (0.38 vs 0.65 ms) and loses at 32 (3.5 vs 1.9 ms). So INT8
weights are dequantized once too.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.parallel.sharding import RowRange

log = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
SUPPORTED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
# The auxiliary tensors of a quantized Linear, after its ``.weight``'s prefix.
WEIGHT_SCALE, INPUT_SCALE, ZERO_POINT = "weight_scale", "input_scale", "weight_zero_point"
WEIGHT_PACKED, WEIGHT_SHAPE = "weight_packed", "weight_shape"
# Per-layer KV-cache scales, as llm-compressor names them (and the older output-scale spelling vLLM also reads).
KV_SCALE_NAMES = {"k": ("self_attn.k_scale", "self_attn.k_proj.output_scale"),
                  "v": ("self_attn.v_scale", "self_attn.v_proj.output_scale")}


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How the targeted Linear weights are stored."""

    dtype: torch.dtype  # torch.float8_e4m3fn or torch.int8
    per_channel: bool  # one scale per output row, else one per tensor
    activations: str  # "none" (weight-only), "static" or "dynamic"


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """A compressed-tensors checkpoint's quantization, as far as loading it is concerned."""

    weights: WeightScheme | None
    ignore: tuple[str, ...]  # layer names (or "re:" patterns) left in full precision
    kv_cache: bool  # carries per-layer k_scale / v_scale
    packed: bool = False  # pack-quantized: INT8 weights in int32 words (``weight_packed``, ``weight_shape``)

    def quantizes(self, weight_name: str) -> bool:
        """Whether ``<layer>.weight`` is stored quantized: a decoder-layer Linear not in ``ignore``."""
        if self.weights is None or not weight_name.endswith("_proj.weight"):
            return False
        layer = weight_name.removesuffix(".weight")
        return not any(_matches(pattern, layer) for pattern in self.ignore)

    def is_auxiliary(self, name: str) -> bool:
        """Whether a checkpoint tensor is a scale this module reads rather than a model parameter."""
        leaf = name.rpartition(".")[2]
        if leaf in (WEIGHT_SCALE, INPUT_SCALE, ZERO_POINT, WEIGHT_PACKED, WEIGHT_SHAPE):
            return True
        return self.kv_cache and any(name.endswith(suffix) for names in KV_SCALE_NAMES.values() for suffix in names)


def _matches(pattern: str, layer: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], layer) is not None
    return layer == pattern or layer.endswith("." + pattern)


def checkpoint_quantization(config: Any) -> CheckpointQuantization | None:
    """The checkpoint's quantization (``None`` when it has none); ``ValueError`` naming the key or the scheme
    for anything the engine does not run."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    values: Mapping[str, Any] = raw if isinstance(raw, Mapping) else raw.to_dict()
    method = values.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported: only {QUANT_METHOD!r} "
                         "checkpoints load")
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        parsed = QuantizationConfig.model_validate(dict(values))
    except ValidationError as error:
        first = error.errors()[0]
        # pydantic names its validators in the path ("function-after[...]"); the keys are the rest.
        key = ".".join(str(part) for part in first["loc"] if "[" not in str(part))
        raise ValueError(f"quantization_config.{key} is invalid: {first['msg']}") from error
    if parsed.format not in SUPPORTED_FORMATS:
        raise ValueError(f"quantization_config.format={parsed.format!r} is not supported: expected one of "
                         f"{', '.join(SUPPORTED_FORMATS)}")
    schemes = [_weight_scheme(f"quantization_config.config_groups.{name}", group)
               for name, group in parsed.config_groups.items()]
    if len(set(schemes)) > 1:
        raise ValueError("quantization_config.config_groups: groups with different schemes are not supported")
    if parsed.kv_cache_scheme is not None:
        _check_kv_scheme(parsed.kv_cache_scheme)
    packed = parsed.format == "pack-quantized"
    if packed and schemes and schemes[0].dtype != torch.int8:
        raise ValueError("quantization_config.format='pack-quantized' is supported for INT8 weights only")
    return CheckpointQuantization(schemes[0] if schemes else None, tuple(parsed.ignore or ()),
                                  parsed.kv_cache_scheme is not None, packed)


def _weight_scheme(where: str, group: Any) -> WeightScheme:
    targets = list(group.targets or [])
    if targets != ["Linear"]:
        raise ValueError(f"{where}.targets={targets} is not supported: expected ['Linear']")
    weights = group.weights
    if weights is None:
        raise ValueError(f"{where}.weights is missing: activation-only quantization is not supported")
    kind, strategy = str(weights.type), str(weights.strategy)
    if weights.num_bits != 8 or kind not in ("float", "int"):
        raise ValueError(f"{where}.weights: {weights.num_bits}-bit {kind} weights are not supported: "
                         "expected 8-bit float (FP8) or int (INT8)")
    if strategy not in ("tensor", "channel"):
        raise ValueError(f"{where}.weights.strategy={strategy!r} is not supported: expected tensor or channel")
    if not weights.symmetric or weights.dynamic:
        raise ValueError(f"{where}.weights: only symmetric, static weight scales are supported")
    activations = group.input_activations
    if activations is None:
        mode = "none"
    else:
        if str(activations.type) != "float" or activations.num_bits != 8:
            raise ValueError(f"{where}.input_activations: {activations.num_bits}-bit {activations.type} "
                             "activations are not supported: expected FP8 or none")
        mode = "dynamic" if activations.dynamic else "static"
    return WeightScheme(torch.float8_e4m3fn if kind == "float" else torch.int8, strategy == "channel", mode)


def _check_kv_scheme(scheme: Any) -> None:
    if scheme.num_bits != 8 or str(scheme.type) != "float" or str(scheme.strategy) != "tensor" or scheme.dynamic:
        raise ValueError(f"quantization_config.kv_cache_scheme ({scheme.num_bits}-bit {scheme.type}, "
                         f"{scheme.strategy}, dynamic={scheme.dynamic}) is not supported: expected static "
                         "per-tensor 8-bit float scales")


def dequantize_weight(name: str, weight: torch.Tensor, scale: torch.Tensor | None, scheme: WeightScheme,
                      dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale`` in ``dtype``; ``ValueError`` naming the tensor for a missing, misshapen or
    non-finite scale, or a weight stored in another dtype than the scheme says."""
    scale_name = name.removesuffix("weight") + WEIGHT_SCALE
    if scale is None:
        raise ValueError(f"checkpoint tensor {scale_name} is missing: {name} is quantized")
    if weight.dtype != scheme.dtype:
        raise ValueError(f"checkpoint tensor {name} is {weight.dtype}, but quantization_config says {scheme.dtype}")
    rows = weight.shape[0]
    expected = "(rows, 1)" if scheme.per_channel else "one value"
    shape_ok = scale.numel() == (rows if scheme.per_channel else 1) and (not scheme.per_channel or scale.dim() == 2)
    if not shape_ok:
        raise ValueError(f"checkpoint tensor {scale_name} has shape {tuple(scale.shape)}: expected {expected} "
                         f"for {name} of shape {tuple(weight.shape)}")
    check_scale(scale_name, scale)
    values = weight.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)
    return values.to(dtype)


def check_scale(name: str, scale: torch.Tensor) -> None:
    """``ValueError`` naming ``name`` unless every value is a finite positive float."""
    if not scale.is_floating_point():
        raise ValueError(f"checkpoint tensor {name} is {scale.dtype}: a scale must be a float tensor")
    values = scale.to(torch.float32)
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ValueError(f"checkpoint tensor {name} holds a scale that is not finite and > 0 "
                         f"(min {float(values.min())}, max {float(values.max())})")


def kv_cache_scales(quantization: CheckpointQuantization | None, num_layers: int,
                    read: Callable[[str], torch.Tensor | None]) -> dict[int, tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale) from a checkpoint with a KV-cache scheme; ``read(name)`` returns a
    checkpoint tensor or ``None`` when absent. ``ValueError`` naming the tensor for a missing or bad one."""
    if quantization is None or not quantization.kv_cache:
        return None
    scales: dict[int, tuple[float, float]] = {}
    for layer in range(num_layers):
        pair = []
        for side in ("k", "v"):
            names = [f"model.layers.{layer}.{suffix}" for suffix in KV_SCALE_NAMES[side]]
            found = next(((name, tensor) for name in names if (tensor := read(name)) is not None), None)
            if found is None:
                raise ValueError(f"checkpoint tensor {names[0]} is missing: quantization_config has a "
                                 "kv_cache_scheme")
            name, tensor = found
            if tensor.numel() != 1:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}: expected one value")
            check_scale(name, tensor)
            pair.append(float(tensor))
        scales[layer] = (pair[0], pair[1])
    return scales


def log_dequantized(scheme: WeightScheme, dtype: torch.dtype, device: torch.device) -> None:
    """The one line saying how a quantized checkpoint runs here."""
    kind = "FP8" if scheme.dtype == torch.float8_e4m3fn else "INT8"
    granularity = "per-channel" if scheme.per_channel else "per-tensor"
    log.info("quantized checkpoint: %s %s weights (activations: %s) dequantized once at load to %s on %s",
             kind, granularity, scheme.activations, str(dtype).removeprefix("torch."), device)


def checkpoint_kv_cache_scales(model_dir: Path, files: list[Path], num_layers: int) -> dict[int, tuple[float, float]] | None:
    """:func:`kv_cache_scales` of the checkpoint in ``model_dir`` (its safetensors ``files``)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    quantization = checkpoint_quantization(AutoConfig.from_pretrained(model_dir))
    if quantization is None or not quantization.kv_cache:
        return None
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(path), framework="pt", device="cpu")) for path in files]
        location = {name: handle for handle in handles for name in handle.keys()}
        return kv_cache_scales(quantization, num_layers,
                               lambda name: location[name].get_tensor(name) if name in location else None)


class QuantizedWeights:
    """The loader's view of a quantized checkpoint: which tensors hold a weight, and the weight itself,
    dequantized into the compute dtype (and cut to a tensor-parallel rank's rows)."""

    def __init__(self, quantization: CheckpointQuantization, dtype: torch.dtype) -> None:
        self.quantization = quantization
        self.dtype = dtype

    @classmethod
    def of_checkpoint(cls, config: Any, dtype: torch.dtype, device: torch.device) -> QuantizedWeights | None:
        """``None`` for a checkpoint without a quantization config; logs the one line when weights are quantized
        (a checkpoint may carry KV-cache scales alone)."""
        quantization = checkpoint_quantization(config)
        if quantization is None:
            return None
        if quantization.weights is not None:
            log_dequantized(quantization.weights, dtype, device)
        return cls(quantization, dtype)

    def quantizes(self, name: str) -> bool:
        return self.quantization.quantizes(name)

    def stored_name(self, name: str) -> str:
        """The checkpoint tensor that holds parameter tensor ``name`` (its packed words when packed)."""
        if self.quantization.packed and self.quantization.quantizes(name):
            return name.removesuffix("weight") + WEIGHT_PACKED
        return name

    def is_auxiliary(self, name: str) -> bool:
        return self.quantization.is_auxiliary(name)

    def load(self, name: str, rows: RowRange | None, read: Callable[[str], torch.Tensor | None]) -> torch.Tensor:
        """Weight ``name`` in the compute dtype; ``rows`` (a tensor-parallel rank's share, or ``None``) cuts it as
        the loader would; ``read(tensor name)`` returns a checkpoint tensor or ``None`` when absent."""
        prefix = name.removesuffix("weight")
        scheme = self.quantization.weights
        if scheme is None:
            raise ValueError(f"{name} is not quantized in this checkpoint")
        if self.quantization.packed:
            weight = _unpacked(prefix, read)
        else:
            weight = read(name)
            if weight is None:
                raise ValueError(f"checkpoint tensor {name} is missing")
        input_scale = read(prefix + INPUT_SCALE)
        if scheme.activations == "static":
            if input_scale is None:
                raise ValueError(f"checkpoint tensor {prefix + INPUT_SCALE} is missing: the activations of "
                                 f"{prefix.rstrip('.')} have static scales")
            check_scale(prefix + INPUT_SCALE, input_scale)
        full = dequantize_weight(name, weight, read(prefix + WEIGHT_SCALE), scheme, self.dtype)
        return full if rows is None else _rows(full, rows)


def _unpacked(prefix: str, read: Callable[[str], torch.Tensor | None]) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32

    packed, shape = read(prefix + WEIGHT_PACKED), read(prefix + WEIGHT_SHAPE)
    for name, tensor in ((WEIGHT_PACKED, packed), (WEIGHT_SHAPE, shape)):
        if tensor is None:
            raise ValueError(f"checkpoint tensor {prefix + name} is missing: the checkpoint is pack-quantized")
    if packed.dtype != torch.int32 or shape.numel() != 2:
        raise ValueError(f"checkpoint tensors {prefix + WEIGHT_PACKED} ({packed.dtype}) and {prefix + WEIGHT_SHAPE} "
                         f"({tuple(shape.tolist())}) are not an int32 packing of a 2-D weight")
    return unpack_from_int32(packed, 8, torch.Size(int(size) for size in shape.tolist()))


def _rows(weight: torch.Tensor, rows: RowRange) -> torch.Tensor:
    """``rows.start:rows.stop`` along ``rows.dim``, zero-padded to ``rows.padded`` (a rank's share)."""
    index: list[slice] = [slice(None)] * weight.dim()
    index[rows.dim] = slice(rows.start, rows.stop)
    part = weight[tuple(index)]
    if rows.size < rows.padded:
        pad = list(part.shape)
        pad[rows.dim] = rows.padded - rows.size
        part = torch.cat([part, part.new_zeros(pad)], dim=rows.dim)
    return part
