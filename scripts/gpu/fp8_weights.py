"""FP8 weights on FP8 tensor cores, for scripts/gpu/fp8_check.py (parts 3 and 4). Each function returns its
number of failures and prints one line per check.

* :func:`scaled_mm_modes`: ``Fp8Linear`` (``torch._scaled_mm``) in each of its scaling modes (tensorwise,
  rowwise with a bfloat16 output, unit scales then both scales) against a quantize-dequantize reference.
* :func:`scaled_mm_decode_step`: the engine with the default model's decoder Linears in e4m3 (per-channel weights,
  dynamic per-token inputs): greedy decode steps and teacher-forced next-token distributions through
  ``_scaled_mm`` against the dequantized path that rounds each Linear's input to FP8 the same way (the same
  arithmetic in float32), and beside it the plain dequantized path (inputs not rounded: what the engine
  runs without FP8 tensor cores). Needs no compressed-tensors package.
* :func:`checkpoint_against_transformers`: a compressed-tensors FP8 checkpoint: the dequantized path gives
  transformers' greedy tokens with input rounding off; the ``_scaled_mm`` path follows transformers with
  it on more closely than the dequantized one does; with CUDA graphs it runs (its tokens against eager's).

Any device works (CPU too, with ``fp8_linear.fp8_tensor_cores`` patched to say yes: torch's CPU build has
``_scaled_mm``), so the script itself is checked off the GPU.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm_bench.kv_accuracy import _distributions
from pagedllm.layers import fp8_linear
from pagedllm.layers.fp8_linear import FP8_DTYPE, FP8_MAX, Fp8Linear, quantize_activations

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _reference(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """The input rounded as Fp8Linear rounds it, times the dequantized weight, in float64."""
    quantized, scale = quantize_activations(x.reshape(-1, layer.in_features), layer.input_scale)
    out = (quantized.double() * scale.double()) @ layer.dequantized_weight().double().t()
    return out if layer.bias is None else out + layer.bias.double()


def scaled_mm_modes(device: torch.device) -> int:
    failures = 0
    generator = torch.Generator(device=device).manual_seed(0)
    out_features, in_features = 1024, 2048
    for out_dtype, weights, activations, tokens in itertools.product(
            (torch.float32, torch.bfloat16), ("per-tensor", "per-channel"), ("static", "dynamic"), (1, 37)):
        weight = (torch.randn(out_features, in_features, device=device, generator=generator) * 100).to(FP8_DTYPE)
        scales = (torch.full((out_features,), 2e-3, device=device) if weights == "per-tensor"
                  else torch.rand(out_features, device=device, generator=generator) * 4e-3 + 1e-3)
        input_scale = torch.tensor(0.02, device=device) if activations == "static" else None
        bias = torch.randn(out_features, device=device, generator=generator)
        layer = Fp8Linear(weight, scales, input_scale, bias, out_dtype)
        x = (torch.randn(tokens, in_features, device=device, generator=generator) * 3).to(out_dtype)
        want = _reference(x, layer)
        error = float((layer(x).double() - want).abs().max() / want.abs().max())
        bound = 1e-5 if out_dtype == torch.float32 else 1e-2
        failures += not error <= bound
        print(f"Fp8Linear {weights} weights, {activations} inputs, {str(out_dtype)[6:]} out, {tokens} tokens: "
              f"max error {error:.1e} of the largest output (bound {bound:.0e})")
    return failures


class EmulatedFp8Linear(nn.Module):
    """The dequantized path with the input rounded to FP8 as Fp8Linear rounds it: the same arithmetic."""

    def __init__(self, layer: Fp8Linear) -> None:
        super().__init__()
        self.layer = layer
        self.weight = layer.dequantized_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized, scale = quantize_activations(x.reshape(-1, self.layer.in_features), self.layer.input_scale)
        out = nn.functional.linear(quantized.float() * scale, self.weight, None if self.layer.bias is None
                                   else self.layer.bias.float())
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def _to_fp8(model: nn.Module, wrap: Callable[[Fp8Linear], nn.Module], dtype: torch.dtype) -> None:
    """Each decoder Linear's weight in e4m3 with one scale per output row (dynamic per-token inputs)."""
    for layer in model.model.layers:
        for path in LINEARS:
            parent_name, _, child = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, child)
            weight = linear.unpacked_weight() if hasattr(linear, "unpacked_weight") else linear.weight
            scales = (weight.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
            quantized = (weight.float() / scales[:, None]).to(FP8_DTYPE)
            setattr(parent, child, wrap(Fp8Linear(quantized, scales, None, linear.bias, dtype)))


def scaled_mm_decode_step(device: torch.device, dtypes: tuple[str, ...]) -> int:
    """On the embedded default model (trained: its next-token choices are not near-ties everywhere, as a random
    model's are), four held-out stdlib prompts of 200 tokens."""
    from pagedllm_bench.kv_accuracy import _default_model_case

    failures = 0
    backend = "triton" if device.type == "cuda" else "torch"
    texts = _default_model_case(4, 16).prompts
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for dtype in dtypes:
        results = {}
        for name, wrap in (("_scaled_mm", lambda layer: layer), ("emulated", EmulatedFp8Linear),
                           ("dequantized", lambda layer: _plain(layer))):
            llm = LLM(dtype=dtype, device=str(device), attention_backend=backend, num_kv_blocks=256)
            _to_fp8(llm.engine.model, wrap, getattr(torch, dtype))
            tokens = [list(o.outputs[0].token_ids) for o in
                      llm.generate([{"prompt_token_ids": t} for t in texts], greedy, use_tqdm=False)]
            results[name] = (tokens, _distributions(llm, texts))
            llm.close()
        reference_tokens, reference = results["emulated"]
        for name in ("_scaled_mm", "dequantized"):
            tokens, ours = results[name]
            top1 = (sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, reference))
                    / sum(len(a) for a in reference))
            gap = max(float((a - b).abs().mean()) for a, b in zip(ours, reference))
            same = sum(a == b for a, b in zip(tokens, reference_tokens))
            print(f"FP8-weight decode, {dtype}, {name} vs dequantized with FP8-rounded inputs: teacher-forced top-1 "
                  f"{100 * top1:.1f}%, mean |dlogp| {gap:.2e}; {same}/{len(texts)} prompts' 16 greedy tokens equal")
            results[name] = (tokens, ours, top1, gap)
        # The same arithmetic up to accumulation order, but rounding an input to FP8 is a step function: an
        # order difference can move an input across a step. So close, and closer than not rounding at all.
        scaled, plain = results["_scaled_mm"], results["dequantized"]
        ok = scaled[2] >= 0.97 and scaled[3] < plain[3]
        failures += not ok
    return failures


def _plain(layer: Fp8Linear) -> nn.Linear:
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                       device=layer.weight_t.device, dtype=layer.out_dtype)
    linear.requires_grad_(False)
    linear.weight.copy_(layer.dequantized_weight())
    if layer.bias is not None:
        linear.bias.copy_(layer.bias)
    return linear


@contextmanager
def scaled_mm_off() -> Iterator[None]:
    """The loader's choice as on a device without FP8 tensor cores: dequantize once."""
    chosen = fp8_linear.fp8_tensor_cores
    fp8_linear.fp8_tensor_cores = lambda device: False
    try:
        yield
    finally:
        fp8_linear.fp8_tensor_cores = chosen


def checkpoint_against_transformers(model: str, out_dir: Path, device: torch.device) -> int:
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from transformers import AutoModelForCausalLM

    from pagedllm.testing.quantized_checkpoint import make_quantized_checkpoint

    failures = 0
    backend = "triton" if device.type == "cuda" else "torch"
    generator = torch.Generator().manual_seed(1)
    texts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (40, 97, 150)]
    for scheme in ("fp8-channel-dynamic", "fp8-tensor-static"):
        checkpoint = make_quantized_checkpoint(Path(model), out_dir / scheme, scheme)
        transformers = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device)
        with torch.no_grad():
            rounded = [torch.log_softmax(transformers(torch.tensor([t], device=device)).logits[0, :-1].float(), -1)
                       .cpu() for t in texts]
            transformers.apply(disable_quantization)
            expected = [transformers.generate(torch.tensor([t[:20]], device=device), max_new_tokens=16,
                                              do_sample=False)[0, 20:].tolist() for t in texts]
        with scaled_mm_off():
            dequantized = LLM(model=str(checkpoint), dtype="float32", device=str(device), attention_backend=backend,
                              num_kv_blocks=256)
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        tokens = [list(o.outputs[0].token_ids) for o in
                  dequantized.generate([{"prompt_token_ids": t[:20]} for t in texts], greedy, use_tqdm=False)]
        same = sum(a == b for a, b in zip(tokens, expected))
        failures += same != len(texts)
        print(f"{scheme} checkpoint, dequantized once: {same}/{len(texts)} prompts give transformers' greedy tokens "
              "(input rounding off)")
        scaled = LLM(model=str(checkpoint), dtype="float32", device=str(device), attention_backend=backend,
                     num_kv_blocks=256)
        on_tensor_cores = isinstance(scaled.engine.model.model.layers[0].mlp.down_proj, Fp8Linear)
        figures = {}
        for name, llm in (("_scaled_mm", scaled), ("dequantized", dequantized)):
            ours = _distributions(llm, texts)
            top1 = (sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, rounded))
                    / sum(len(a) for a in rounded))
            figures[name] = (top1, max(float((a - b).abs().mean()) for a, b in zip(ours, rounded)))
            print(f"{scheme} checkpoint, {name} vs transformers rounding inputs to FP8: teacher-forced top-1 "
                  f"{100 * figures[name][0]:.1f}%, mean |dlogp| {figures[name][1]:.2e}")
        ok = (on_tensor_cores and figures["_scaled_mm"][0] >= 0.85
              and figures["_scaled_mm"][1] < figures["dequantized"][1])
        failures += not ok
        # Decode steps replayed as CUDA graphs: it must capture and run. Reported, not failed on token equality: a
        # graph's padded batch may pick another GEMM kernel, and an FP8-rounded input can then step the other way.
        if device.type == "cuda":
            eager = [list(o.outputs[0].token_ids) for o in
                     scaled.generate([{"prompt_token_ids": t[:20]} for t in texts], greedy, use_tqdm=False)]
            graphs = LLM(model=str(checkpoint), dtype="float32", device=str(device), attention_backend=backend,
                         num_kv_blocks=256, cuda_graphs=True, max_num_seqs=16)
            replayed = [list(o.outputs[0].token_ids) for o in
                        graphs.generate([{"prompt_token_ids": t[:20]} for t in texts], greedy, use_tqdm=False)]
            same = sum(a == b for a, b in zip(eager, replayed))
            print(f"{scheme} checkpoint, _scaled_mm with CUDA graphs: {same}/{len(texts)} prompts give the eager "
                  "tokens")
        if not on_tensor_cores:
            print(f"{scheme} checkpoint: the loader did not choose _scaled_mm on {device}")
    return failures
