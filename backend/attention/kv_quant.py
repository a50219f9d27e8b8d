"""8-bit KV cache: which torch dtype a ``kv_cache_dtype`` names, and each layer's K and V scales.

A quantized cache stores ``x / scale`` saturated to the format's range and reads back
``stored * scale`` (:mod:`pagedllm.kernels.reference`). Scales are per layer, one for K and
one for V, as vLLM's ``k_scale``/``v_scale``. They come from the checkpoint when it carries
them (compressed-tensors' KV-cache scheme), else they are 1.0, or, with
``calculate_kv_scales``, they are measured on the first prefill the engine runs. Every layer's
scales are fp32 one-element tensors on the cache's device, so kernels read them as data and a
measured scale changes no compiled kernel or captured graph.

A measured scale is a power of two: the smallest one that maps twice the first prefill's
largest |K| (|V|) into the format's range. An 8-bit float format is a floating-point grid, so
dividing by a power of two moves values between binades without changing how any normal value
rounds: the measured exponent only decides where the range ends. Where 1.0 already holds twice
the largest value, the measured scale is at most 1.0 and its grid holds every point of 1.0's
grid below that bound (and finer ones where 1.0 leaves values subnormal), so no such K or V value
is stored less exactly than with 1.0; where 1.0 does not, the measured scale keeps the values
from saturating. A scale that is not a power of two (largest value / 448, or vLLM's largest
value / 200 for K and / 100 for V) shifts the grid against the values: on the embedded model
that rounds a different 0.1-0.2% of near-tied next tokens the other way (RESULTS, "FP8 KV
cache"), a change no principle makes better or worse.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from pagedllm.kernels.reference import FP8_DTYPES

KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# A measured scale maps at least this multiple of the first prefill's largest |K| (or |V|) to the format's largest
# value: later tokens may be larger than any seen so far, and saturating them costs more than a coarser grid.
MEASURED_SCALE_HEADROOM = 2.0


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype: the model's for ``auto``, else the named 8-bit format."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


class LayerKvScales:
    """One layer's K and V scales; ``pending`` until measured when the engine computes them."""

    __slots__ = ("k", "v", "pending", "cache_dtype")

    def __init__(self, k: float, v: float, cache_dtype: torch.dtype, device: torch.device, pending: bool) -> None:
        for name, value in (("k_scale", k), ("v_scale", v)):
            if not (value > 0 and value != float("inf")):
                raise ValueError(f"{name}={value} is invalid: KV cache scales must be finite and > 0")
        self.k = torch.tensor([k], dtype=torch.float32, device=device)
        self.v = torch.tensor([v], dtype=torch.float32, device=device)
        self.cache_dtype = cache_dtype
        self.pending = pending

    def measure(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Set both scales from this prefill's keys and values, in place, once (on the device: no host sync)."""
        largest = torch.finfo(self.cache_dtype).max
        tiny = torch.finfo(torch.float32).tiny
        for scale, rows in ((self.k, key), (self.v, value)):
            wanted = rows.detach().abs().amax().float().clamp(min=tiny) * (MEASURED_SCALE_HEADROOM / largest)
            scale.copy_(torch.exp2(torch.ceil(torch.log2(wanted))))
        self.pending = False


def make_kv_scales(
    num_layers: int,
    cache_dtype: torch.dtype,
    device: torch.device,
    checkpoint_scales: Mapping[int, tuple[float, float]] | None = None,
    calculate: bool = False,
) -> list[LayerKvScales] | None:
    """Each layer's scales for an 8-bit cache (``None`` for a full-precision one).

    ``checkpoint_scales`` (layer -> (k_scale, v_scale)) win over ``calculate``: a checkpoint
    that carries scales was calibrated on more than one prompt.
    """
    if cache_dtype not in FP8_DTYPES:
        return None
    if checkpoint_scales:
        absent = sorted(set(range(num_layers)) - set(checkpoint_scales))
        if absent:
            raise ValueError(f"the checkpoint carries KV cache scales for some layers but not layers {absent}")
        return [LayerKvScales(*checkpoint_scales[layer], cache_dtype, device, pending=False)
                for layer in range(num_layers)]
    return [LayerKvScales(1.0, 1.0, cache_dtype, device, pending=calculate) for _ in range(num_layers)]


def prepare_kv_cache(
    layers: Sequence[nn.Module],
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    device: torch.device,
    checkpoint_scales: Mapping[int, tuple[float, float]] | None = None,
    calculate: bool = False,
) -> torch.dtype:
    """The cache dtype for ``kv_cache_dtype``; an 8-bit one also gives every decoder layer's attention
    (``layer.self_attn``) its scales. Every rank of a tensor-parallel group calls it the same way."""
    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, model_dtype)
    scales = make_kv_scales(len(layers), cache_dtype, device, checkpoint_scales, calculate)
    if scales is not None:
        for layer, layer_scales in zip(layers, scales):
            layer.self_attn.kv_scales = layer_scales
    return cache_dtype
