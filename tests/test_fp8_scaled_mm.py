"""FP8 weights on FP8 tensor cores (``torch._scaled_mm``): when the loader chooses it, what Fp8Linear computes,
and the engine on a compressed-tensors FP8 checkpoint with the path forced on this CPU (torch's CPU build runs
``_scaled_mm`` for e4m3, so the code the GPU runs is checked here; scripts/gpu/fp8_check.py runs it on CUDA)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm import LLM
from pagedllm_bench.kv_accuracy import _distributions
from pagedllm.layers import fp8_linear
from pagedllm.layers.fp8_linear import FP8_DTYPE, FP8_MAX, Fp8Linear, fp8_tensor_cores
from pagedllm.layers.quantization import CheckpointQuantization, QuantizedWeights, WeightScheme, uses_scaled_mm
from pagedllm.distributed.sharding import RowRange
from pagedllm.testing.quantized_checkpoint import make_quantized_checkpoint

from installed import need
need("compressed_tensors")

FP8_CHANNEL = WeightScheme(FP8_DTYPE, per_channel=True, activations="dynamic")


def _cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize(("capability", "expected"), [((8, 9), True), ((9, 0), True), ((10, 0), True),
                                                      ((8, 6), False), ((8, 0), False)])
def test_scaled_mm_runs_on_cuda_devices_with_fp8_tensor_cores_only(monkeypatch: pytest.MonkeyPatch,
                                                                    capability: tuple[int, int],
                                                                    expected: bool) -> None:
    _cuda(monkeypatch, capability)
    cuda = torch.device("cuda", 0)
    assert fp8_tensor_cores(cuda) is expected
    assert uses_scaled_mm(FP8_CHANNEL, cuda) is expected
    assert not uses_scaled_mm(WeightScheme(torch.int8, True, "none"), cuda)  # INT8 weights dequantize
    assert not uses_scaled_mm(None, cuda)  # KV-cache scales alone
    assert not fp8_tensor_cores(torch.device("cpu"))


def _reference(x: torch.Tensor, weight: torch.Tensor, row_scales: torch.Tensor, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.Tensor:
    """Quantize-dequantize the input as compressed-tensors does, then the product in float64."""
    if input_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=fp8_linear.MIN_DYNAMIC_SCALE)
    else:
        scale = input_scale
    rounded = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).double() * scale.double()
    out = rounded @ (weight.double() * row_scales.double().reshape(-1, 1)).t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights", ["per-tensor", "per-channel"])
@pytest.mark.parametrize("activations", ["static", "dynamic"])
def test_fp8_linear_matches_quantize_dequantize_reference(out_dtype: torch.dtype, weights: str,
                                                          activations: str) -> None:
    """Every scaling mode: tensorwise (static, per-tensor), rowwise (bf16 output), unit scales then both scales."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = 48, 64
    weight = (torch.randn(out_features, in_features, generator=generator) * 100).to(FP8_DTYPE)
    if weights == "per-tensor":
        row_scales = torch.full((out_features,), 0.003)
    else:
        row_scales = torch.rand(out_features, generator=generator) * 0.01 + 0.001
    input_scale = torch.tensor(0.02) if activations == "static" else None
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(3, 5, in_features, generator=generator) * 3
    x[0, 0] = 0.0  # a padding token: its dynamic scale must stay positive
    x[1, 1, 0] = 50.0  # saturates at the static scale (50 / 0.02 > 448)
    layer = Fp8Linear(weight, row_scales, input_scale, bias, out_dtype)
    assert (layer.tensor_scale is not None) is (weights == "per-tensor")
    got = layer(x.to(out_dtype))
    assert got.shape == (3, 5, out_features) and got.dtype == out_dtype
    want = _reference(x.to(out_dtype).float().reshape(-1, in_features), weight, row_scales, input_scale, bias)
    tolerance = 1e-5 if out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.reshape(-1, out_features).double(), want, rtol=tolerance, atol=tolerance)
    one_token = layer(x[1, 1:2].to(out_dtype))  # a decode step of one sequence: [1, 1] activation scales
    torch.testing.assert_close(one_token.double(), want[6:7], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(layer.dequantized_weight(), weight.float() * row_scales.reshape(-1, 1))


def test_fp8_linear_refuses_a_weight_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Linear(torch.zeros(16, 16), torch.ones(16), None, None, torch.float32)
    with pytest.raises(ValueError, match="weight_scale has 1 values for 16"):
        Fp8Linear(torch.zeros(16, 16).to(FP8_DTYPE), torch.ones(1), None, None, torch.float32)


def test_a_tensor_parallel_share_keeps_its_rows_scales() -> None:
    """Column-parallel shares cut the output rows and their scales; row-parallel ones cut the inputs only;
    a share shorter than a rank's is zero-padded."""
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(32, 48, generator=generator) * 50).to(FP8_DTYPE)
    scale = torch.rand(32, 1, generator=generator) + 0.5
    tensors = {"p.weight": weight, "p.weight_scale": scale}
    quantized = QuantizedWeights(CheckpointQuantization(FP8_CHANNEL, ignore=(), kv_cache=False), torch.float32,
                                 scaled_mm=True)
    quantized._fp8_parts = {"p.weight": None}  # as plan() marks a Linear's parts
    full = weight.float() * scale
    for rows in (RowRange(0, 16, 32, 16), RowRange(1, 24, 48, 24), RowRange(0, 24, 32, 16), RowRange(1, 40, 48, 16)):
        placeholder = quantized.load("p.weight", rows, tensors.get)
        part = quantized._fp8_parts["p.weight"]
        assert placeholder.is_meta and placeholder.shape == part.weight.shape
        assert part.weight.shape[rows.dim] == rows.padded
        got = (part.weight.float() * part.row_scales.reshape(-1, 1)).narrow(rows.dim, 0, rows.size)
        assert torch.equal(got, full.narrow(rows.dim, rows.start, rows.size))
        assert not part.weight.float().narrow(rows.dim, rows.size, rows.padded - rows.size).any()


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
                   ) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def build(scheme: str) -> Path:
        if scheme not in built:
            built[scheme] = make_quantized_checkpoint(tiny_model_dir("qwen2"), tmp_path_factory.mktemp(scheme), scheme)
        return built[scheme]

    return build


def _transformers_rounding(model_dir: Path, texts: list[list[int]]) -> list[torch.Tensor]:
    """transformers through compressed-tensors: dequantized weights, inputs rounded to FP8 (what _scaled_mm does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([t])).logits[0, :-1].float(), -1) for t in texts]


@pytest.mark.parametrize("scheme", ["fp8-channel-dynamic", "fp8-tensor-static"])
def test_engine_runs_fp8_checkpoint_linears_with_scaled_mm(fp8_checkpoint, scheme: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Forced on this CPU: every decoder Linear is an Fp8Linear (qwen2's q|k|v bias kept), the load logs it, and the
    next-token distributions follow transformers rounding the inputs the same way, not the dequantized path's."""
    model_dir = fp8_checkpoint(scheme)
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(3, 2000, (n,), generator=generator).tolist() for n in (40, 97)]
    dequantized = _distributions(LLM(str(model_dir), dtype="float32", num_kv_blocks=64, attention_backend="torch"),
                                 texts)
    monkeypatch.setattr(fp8_linear, "fp8_tensor_cores", lambda device: True)
    with caplog.at_level(logging.INFO, logger="pagedllm.layers.quantization"):
        llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, attention_backend="torch")
    assert [r for r in caplog.records if "run with torch._scaled_mm" in r.getMessage()]
    attention = llm.engine.model.model.layers[0].self_attn
    mlp = llm.engine.model.model.layers[0].mlp
    for layer in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
        assert isinstance(layer, Fp8Linear)
        assert layer.weight_t.dtype == FP8_DTYPE
    assert attention.qkv_proj.bias is not None
    scaled = _distributions(llm, texts)
    reference = _transformers_rounding(model_dir, texts)

    def top1(ours: list[torch.Tensor]) -> float:
        same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, reference))
        return same / sum(len(a) for a in reference)

    def gap(ours: list[torch.Tensor]) -> float:
        return max(float((a - b).abs().mean()) for a, b in zip(ours, reference))

    # A random-weight model flips near-ties on any perturbation, and rounding an input to FP8 is a step function:
    # fp32 accumulation-order differences move some inputs across a step. So: much closer, not identical.
    assert top1(scaled) >= 0.9 and top1(scaled) > top1(dequantized)
    assert gap(scaled) < 0.25 * gap(dequantized)
