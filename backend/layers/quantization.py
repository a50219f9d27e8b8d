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

On a CUDA device with FP8 tensor cores (compute capability 8.9+), FP8 weights stay in 8 bits and
their Linears run ``torch._scaled_mm`` with the checkpoint's activation scheme
(:mod:`pagedllm.layers.fp8_linear`). Elsewhere, and for INT8, weights are dequantized once at
load into the compute dtype (:class:`QuantizedWeights`); activation quantization is then not
emulated: the forward runs in the compute dtype, as vLLM does on hardware without FP8 support,
and a static ``input_scale`` is still checked, so a corrupt one fails the load. One log line
says which of the two a load does.

On a CPU, torch's int8 weight-packed matmul (``aten._weight_int8pack_mm``) was measured
against dequantizing once (``scripts/ab_int8_weight_matmul.py``): with float32 activations, the
engine's CPU default, it is many times slower than the packed float32 GEMM; with bfloat16
activations it wins only at one row and loses at bigger batches (measured: RESULTS.md, "Figures
behind the code's choices"). So INT8 weights are dequantized once too.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.layers import fp8_linear
from pagedllm.layers.fp8_linear import Fp8Linear
from pagedllm.distributed.sharding import RowRange

if TYPE_CHECKING:
    from pagedllm.layers.tensor_parallel import ParameterSource

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
    """``weight * scale`` in ``dtype``; ``ValueError`` as :func:`checked_weight_scale`."""
    scale = checked_weight_scale(name, weight, scale, scheme)
    values = weight.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)
    return values.to(dtype)


def checked_weight_scale(name: str, weight: torch.Tensor, scale: torch.Tensor | None,
                         scheme: WeightScheme) -> torch.Tensor:
    """``scale``; ``ValueError`` naming the tensor for a missing, misshapen or non-finite scale, or a weight
    stored in another dtype than the scheme says."""
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
    return scale


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


def log_quantized(scheme: WeightScheme, dtype: torch.dtype, device: torch.device, scaled_mm: bool) -> None:
    """The one line saying how a quantized checkpoint runs here."""
    kind = "FP8" if scheme.dtype == torch.float8_e4m3fn else "INT8"
    granularity = "per-channel" if scheme.per_channel else "per-tensor"
    how = ("kept in 8 bits, run with torch._scaled_mm on FP8 tensor cores (%s output)" if scaled_mm
           else "dequantized once at load to %s")
    log.info(f"quantized checkpoint: %s %s weights (activations: %s) {how} on %s",
             kind, granularity, scheme.activations, str(dtype).removeprefix("torch."), device)


def uses_scaled_mm(scheme: WeightScheme | None, device: torch.device) -> bool:
    """Whether this checkpoint's Linears run ``torch._scaled_mm`` on ``device``: FP8 weights on FP8 tensor cores."""
    return scheme is not None and scheme.dtype == torch.float8_e4m3fn and fp8_linear.fp8_tensor_cores(device)


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


@dataclass(frozen=True, slots=True)
class Fp8Part:
    """One checkpoint part of an FP8 Linear that runs ``_scaled_mm``: its e4m3 rows (a rank's share), their
    scales, one per output row, and its static input scale (``None``: dynamic)."""

    weight: torch.Tensor
    row_scales: torch.Tensor
    input_scale: torch.Tensor | None


class QuantizedWeights:
    """The loader's view of a quantized checkpoint: which tensors hold a weight, and the weight itself,
    dequantized into the compute dtype (and cut to a tensor-parallel rank's rows), or, for Linears that run on
    FP8 tensor cores, kept in e4m3 until :meth:`install` puts :class:`Fp8Linear` modules in their place."""

    def __init__(self, quantization: CheckpointQuantization, dtype: torch.dtype, scaled_mm: bool = False) -> None:
        self.quantization = quantization
        self.dtype = dtype
        self.scaled_mm = scaled_mm
        self._fp8_params: dict[str, tuple[str, ...]] = {}  # parameter -> its checkpoint parts, in order
        self._fp8_parts: dict[str, Fp8Part | None] = {}  # filled by load()

    @classmethod
    def of_checkpoint(cls, config: Any, dtype: torch.dtype, device: torch.device) -> QuantizedWeights | None:
        """``None`` for a checkpoint without a quantization config; logs the one line when weights are quantized
        (a checkpoint may carry KV-cache scales alone)."""
        quantization = checkpoint_quantization(config)
        if quantization is None:
            return None
        scaled_mm = uses_scaled_mm(quantization.weights, device)
        if quantization.weights is not None:
            log_quantized(quantization.weights, dtype, device, scaled_mm)
        return cls(quantization, dtype, scaled_mm)

    def plan(self, model: nn.Module, sources: Mapping[str, ParameterSource]) -> None:
        """With ``scaled_mm``, choose the Linears that run it: every part quantized (a fused q|k|v or gate|up
        needs all three or both), not stacked experts, and ``_scaled_mm``'s shape rule met. The rest dequantize."""
        if not self.scaled_mm:
            return
        for param, source in sources.items():
            prefix, _, leaf = param.rpartition(".")
            if leaf != "weight" or source.stack or not all(self.quantizes(part.name) for part in source.parts):
                continue
            module = model.get_submodule(prefix)
            if isinstance(module, nn.Linear) and fp8_linear.fits_scaled_mm(module.out_features, module.in_features):
                self._fp8_params[param] = tuple(part.name for part in source.parts)
                self._fp8_parts.update((part.name, None) for part in source.parts)

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
        the loader would; ``read(tensor name)`` returns a checkpoint tensor or ``None`` when absent. A part of a
        planned ``_scaled_mm`` Linear is kept in e4m3 and this returns a placeholder of its shape on the meta
        device (no memory): :meth:`install` builds the module."""
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
        scale = read(prefix + WEIGHT_SCALE)
        if name not in self._fp8_parts:
            full = dequantize_weight(name, weight, scale, scheme, self.dtype)
            return full if rows is None else _rows(full, rows)
        scale = checked_weight_scale(name, weight, scale, scheme).float().reshape(-1).expand(weight.shape[0])
        if rows is not None:
            weight = _rows(weight, rows)
            if rows.dim == 0:  # a column-parallel share: its output rows' scales (padding rows are zeros anyway)
                scale = _rows(scale.contiguous(), rows)
        static = input_scale.float().reshape(()) if scheme.activations == "static" and input_scale is not None else None
        self._fp8_parts[name] = Fp8Part(weight.contiguous(), scale.contiguous(), static)
        return torch.empty(weight.shape, dtype=self.dtype, device="meta")

    def install(self, model: nn.Module) -> None:
        """Put an :class:`Fp8Linear` in place of every planned Linear (whose weight :meth:`load` left on the meta
        device), its bias kept."""
        for param, part_names in self._fp8_params.items():
            parts = [self._fp8_parts[name] for name in part_names]
            if any(part is None for part in parts):
                raise ValueError(f"{param}: its checkpoint parts {list(part_names)} were not all loaded")
            loaded = [part for part in parts if part is not None]
            statics = [part.input_scale for part in loaded]
            input_scale = None if any(s is None for s in statics) else torch.stack(statics).amax()  # type: ignore[misc]
            parent_name, _, child = param.removesuffix(".weight").rpartition(".")
            module = model.get_submodule(param.removesuffix(".weight"))
            bias = module.bias if isinstance(module, nn.Linear) else None
            setattr(model.get_submodule(parent_name), child, Fp8Linear(
                torch.cat([part.weight for part in loaded]), torch.cat([part.row_scales for part in loaded]),
                input_scale, bias, self.dtype))
        self._fp8_parts = dict.fromkeys(self._fp8_parts)  # the modules hold the tensors now


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
