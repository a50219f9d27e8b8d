"""The compiled elementwise steps (``models/cpu_fused.c``) against the torch ops they replace, and the
model with them switched off (its numbers against transformers, switched on, are in test_models.py)."""
from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import cpu_fused_ops as fused_module
from pagedllm.platform.cpu_dtypes import native_cpu_dtypes
from pagedllm.layers.cpu_fused_ops import CpuFusedOps, cpu_fused_ops
from pagedllm.layers.norm_rotary import RMSNorm, apply_rotary
from pagedllm.platform.native_build import CACHE_ENV

from test_models import load, make_caches, make_sequences, reference_logits, run_step

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
CPU = torch.device("cpu")


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Each load builds or refuses anew, into a private cache."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    fused_module._load.cache_clear()
    yield
    fused_module._load.cache_clear()


@pytest.fixture
def ops() -> CpuFusedOps:
    loaded = cpu_fused_ops(torch.float32, CPU)
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 512 crosses the size where it goes parallel
def test_rms_norm_with_and_without_the_residual_add_matches_torch(ops: CpuFusedOps, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 512, generator=generator), torch.randn(rows, 512, generator=generator) * 4
    norm = RMSNorm(512, 1e-6)
    norm.weight.data = torch.randn(512, generator=generator)
    expected_stream = residual + x
    expected = norm(expected_stream)
    norm.fused = ops
    torch.testing.assert_close(norm(expected_stream), expected, atol=2e-6, rtol=2e-6)
    out, stream = norm.add_and_norm(x, residual)
    assert stream is residual  # updated in place: the layer's skip connection
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)


def test_rotary_in_place_gives_torchs_bits_on_q_and_k_only(ops: CpuFusedOps) -> None:
    generator = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim = 9, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=generator) * 40
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q, k, v = qkv.clone().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q = apply_rotary(q.reshape(tokens, heads, head_dim), cos, sin)
    expected_k = apply_rotary(k.reshape(tokens, kv_heads, head_dim), cos, sin)
    ops.rotate_(qkv, cos, sin, heads + kv_heads, head_dim)
    rotated_q, rotated_k, same_v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(rotated_q.reshape(tokens, heads, head_dim), expected_q)
    assert torch.equal(rotated_k.reshape(tokens, kv_heads, head_dim), expected_k)
    assert torch.equal(same_v, v)


def test_silu_and_mul_matches_torch_including_large_and_tiny_gates(ops: CpuFusedOps) -> None:
    gate = torch.cat([torch.linspace(-120, 120, 2048), torch.tensor([0.0, -0.0, 1e-30, -1e-30] * 4)])
    up = torch.randn(gate.shape[0], generator=torch.Generator().manual_seed(5))
    gate_up = torch.cat([gate, up]).reshape(1, -1)
    torch.testing.assert_close(ops.silu_mul(gate_up), (F.silu(gate) * up)[None], atol=1e-6, rtol=2e-6)


def test_bf16_silu_and_mul_gives_torchs_bits_on_every_gate(ops: CpuFusedOps) -> None:
    """Every bf16 gate value, infinities and NaNs included, gives torch's bits: silu comes from a table of
    torch's own silu, and the product is rounded once, as torch's bf16 multiply rounds it. The row's width
    leaves a tail past the last full vector, which runs the scalar loop."""
    if torch.bfloat16 not in native_cpu_dtypes():
        pytest.skip("this CPU does not compute bf16 natively: bf16 models keep torch's ops")
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = (torch.randn(gate.numel(), generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    gate_up = torch.cat([gate[:-5], up[:-5]]).reshape(1, -1)  # 65531 wide: a tail of 11 past the last 16
    got, expected = ops.silu_mul(gate_up)[0], F.silu(gate[:-5]) * up[:-5]
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_bf16_steps_round_where_torchs_bf16_ops_round(ops: CpuFusedOps) -> None:
    """What transformers computes in a bf16 model, bit for bit: RMSNorm (its residual add and its float32
    sum of squares in torch's order, over widths that take every branch of that order), the rotary and
    SiLU-and-multiply."""
    if torch.bfloat16 not in native_cpu_dtypes():
        pytest.skip("this CPU does not compute bf16 natively: bf16 models keep torch's ops")
    assert torch.bfloat16 in ops.norm_dtypes  # this torch's summation order is reproduced
    generator = torch.Generator().manual_seed(0)
    rows = 37
    for width in (100, 896, 2048, 5000):
        x = (torch.randn(rows, width, generator=generator) * 3).bfloat16()
        residual = (torch.randn(rows, width, generator=generator) * 50).bfloat16()
        weight = (1 + 0.1 * torch.randn(width, generator=generator)).bfloat16()
        norm = RMSNorm(width, 1e-6)
        norm.weight.data = weight
        expected_stream = residual + x
        expected = norm(expected_stream)
        fused = RMSNorm(width, 1e-6, ops)
        fused.weight.data = weight
        got, stream = fused.add_and_norm(x, residual)
        assert stream is residual  # the compiled path ran: it adds in place
        assert torch.equal(got, expected) and torch.equal(stream, expected_stream), f"width {width}"
    rows, width = 37, 896

    gate_up = (torch.randn(rows, 2 * 300, generator=generator) * 4).bfloat16()
    gate, up = gate_up.split(300, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)

    heads, head_dim = 6, 64
    qkv = (torch.randn(rows, (heads + 2) * head_dim, generator=generator) * 5).bfloat16()
    angles = torch.randn(rows, head_dim // 2, generator=generator) * 3
    cos, sin = torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16()
    rotated = qkv.clone()
    ops.rotate_(rotated, cos, sin, heads, head_dim)
    q = qkv[:, : heads * head_dim].reshape(rows, heads, head_dim)
    assert torch.equal(rotated[:, : heads * head_dim].reshape(rows, heads, head_dim),
                       apply_rotary(q, cos[:, None], sin[:, None]))
    assert torch.equal(rotated[:, heads * head_dim :], qkv[:, heads * head_dim :])


def test_it_refuses_tensors_it_would_misread(ops: CpuFusedOps) -> None:
    with pytest.raises(ValueError, match="expected a dense torch.float32 or torch.bfloat16 CPU tensor, got "
                                         "torch.float16"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="expected a dense torch.bfloat16 CPU tensor, got torch.float32"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="expected float32 or bf16 rows, got torch.float16"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float16), None, torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="expected a dense torch.float32 or torch.bfloat16 CPU tensor"):
        ops.rotate_(torch.zeros(8, 4).T, torch.zeros(4, 2), torch.zeros(4, 2), 1, 2)


def test_it_refuses_sizes_that_would_reach_past_a_buffer(ops: CpuFusedOps) -> None:
    with pytest.raises(ValueError, match="needs a weight of 8"):
        ops.rms_norm(torch.zeros(2, 8), None, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual of the same shape"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(1, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="do not fit rows"):
        ops.rotate_(torch.zeros(3, 16), torch.zeros(3, 8), torch.zeros(3, 8), 3, 8)
    # A partial rotary (cos/sin narrower than the head) must not reach the C side.
    with pytest.raises(ValueError, match="the whole head rotates"):
        ops.rotate_(torch.zeros(3, 16), torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), 2, 8)
    with pytest.raises(ValueError, match="even width"):
        ops.silu_mul(torch.zeros(2, 7))


def test_switched_off_the_model_runs_torch_ops_and_still_matches_transformers(
    tiny_model_dir: Callable[[str], Path], fresh_load: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fused_module.SWITCH_ENV, "0")
    model_dir = tiny_model_dir("llama")
    model = load(model_dir)
    assert [m.fused for m in model.modules() if isinstance(m, RMSNorm)] == [None] * (2 * model.num_layers + 1)
    assert not list(tmp_path.glob("cpu_fused-*.so"))
    caches = make_caches(model)
    (seq,) = make_sequences([44], seed=1, vocab_size=model.vocab_size)
    run_step(model, caches, [(seq, 23)])
    run_step(model, caches, [(seq, 21)])
    torch.testing.assert_close(torch.cat(seq.logits), reference_logits(model_dir, seq.tokens), atol=1e-4, rtol=0)


def test_without_a_compiler_torch_ops_run_and_the_log_says_why(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger=fused_module.__name__):
        assert cpu_fused_ops(torch.float32, CPU) is None
    assert "plain torch ops" in caplog.text


def test_float32_and_native_bf16_on_a_cpu_get_them() -> None:
    assert (cpu_fused_ops(torch.bfloat16, CPU) is not None) == (torch.bfloat16 in native_cpu_dtypes())
    assert cpu_fused_ops(torch.float16, CPU) is None
    assert cpu_fused_ops(torch.float32, torch.device("cuda")) is None
