"""Quantized test checkpoints in the compressed-tensors format, made locally from a tiny checkpoint.

The ``compressed-tensors`` package does the work llm-compressor would: it attaches the
scheme to every targeted Linear, and its ``ModelCompressor`` writes the 8-bit weights,
their scales and the ``quantization_config``. The scales are computed here as
llm-compressor's min-max observers would: the largest magnitude (per tensor or per output
row) maps to the format's largest value; static activation and KV-cache scales come from
one calibration forward over a fixed batch of token ids.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SCHEMES = ("fp8-channel-dynamic", "fp8-tensor-static", "int8-channel")
FP8_MAX = 448.0
INT8_MAX = 127.0


def make_quantized_checkpoint(source: Path, out_dir: Path, scheme: str, kv_cache_scales: bool = False) -> Path:
    """Write ``source`` quantized by ``scheme`` (one of :data:`SCHEMES`) into ``out_dir``; with
    ``kv_cache_scales`` also per-layer ``k_scale`` / ``v_scale`` (compressed-tensors' KV-cache scheme)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)

    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not one of {', '.join(SCHEMES)}")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    kind, granularity, activations = (scheme.split("-") + ["none"])[:3]
    weights = QuantizationArgs(num_bits=8, type="float" if kind == "fp8" else "int", strategy=granularity,
                               symmetric=True, dynamic=False)
    inputs = None if activations == "none" else QuantizationArgs(
        num_bits=8, type="float", strategy="token" if activations == "dynamic" else "tensor", symmetric=True,
        dynamic=activations == "dynamic")
    kv_scheme = (QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
                 if kv_cache_scales else None)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)},
        ignore=["lm_head"], kv_cache_scheme=kv_scheme, quantization_status=QuantizationStatus.INITIALIZED)
    input_amax, output_amax = _calibrate(model)
    apply_quantization_config(model, config)
    largest = FP8_MAX if kind == "fp8" else INT8_MAX
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            magnitude = module.weight.detach().abs()
            amax = magnitude.amax(dim=1, keepdim=True) if granularity == "channel" else magnitude.amax().reshape(1)
            module.weight_scale.data.copy_((amax / largest).reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale") and activations == "static":
            module.input_scale.data.fill_(input_amax[name] / FP8_MAX)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format="float-quantized" if kind == "fp8" else "pack-quantized")
    compressor.compress_model(model)
    state = model.state_dict()
    if kv_cache_scales:
        for layer in range(model.config.num_hidden_layers):
            prefix = f"model.layers.{layer}.self_attn."
            for side in ("k", "v"):
                state[f"{prefix}{side}_scale"] = torch.tensor(output_amax[f"{prefix}{side}_proj"] / FP8_MAX)
    model.save_pretrained(out_dir, state_dict=state)
    compressor.update_config(str(out_dir))
    if kv_scheme is not None:  # the compressor writes the Linear schemes it finds; the KV scheme is the config's
        config_path = Path(out_dir) / "config.json"
        values = json.loads(config_path.read_text())
        values["quantization_config"]["kv_cache_scheme"] = kv_scheme.model_dump(mode="json")
        config_path.write_text(json.dumps(values, indent=2))
    AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)
    generation = Path(source) / "generation_config.json"
    if generation.is_file():
        (Path(out_dir) / "generation_config.json").write_text(generation.read_text())
    return Path(out_dir)


def _calibrate(model: torch.nn.Module) -> tuple[dict[str, float], dict[str, float]]:
    """Each Linear's largest input and output magnitude over one fixed batch."""
    input_amax: dict[str, float] = {}
    output_amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor,
                       name: str = name) -> None:
                input_amax[name] = float(args[0].abs().max())
                output_amax[name] = float(output.abs().max())
            hooks.append(module.register_forward_hook(record))
    ids = torch.randint(1, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return input_amax, output_amax
