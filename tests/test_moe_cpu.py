"""The compiled CPU MoE experts (moe_experts.c) against their oracle, the plain-torch reference; how they are
built and refused; and that a float32 CPU model's MoE blocks run them (token-exactness against transformers
is test_moe_models.py's, which runs them too)."""
from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagedllm.kernels.fused_moe_reference import fused_moe_ref
from pagedllm import LLM, SamplingParams
from pagedllm.layers import moe_cpu
from pagedllm.layers.moe import SparseMoeBlock
from pagedllm.layers.cpu_linear import packed_linear_choice
from pagedllm.layers.moe_bf16 import load_native_moe_bf16
from pagedllm.layers.moe_cpu import NativeMoe, load_native_moe
from pagedllm.layers.moe_onednn import OneDnnExperts

from test_fused_moe import CASES, Case, make_inputs

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
FLOAT32_CASES = {name: case for name, case in CASES.items() if case.dtype == torch.float32}
# Wider than the fused kernel's cases: rows in every remainder of the routine's 4-row tiles, widths that are
# not multiples of its 8-float vectors nor of its 64-column tiles, an odd hidden width, 1-16 rows per expert.
WIDE_CASES = {
    "decode-32-e16-top4": Case(32, 256, 128, 16, 4, CASES["top1-e4"].tiles),
    "prefill-301-e12-top4": Case(301, 72, 44, 12, 4, CASES["top1-e4"].tiles),
    "odd-widths-e5-top3": Case(9, 131, 13, 5, 3, CASES["top1-e4"].tiles),
    "one-token-e64-top8": Case(1, 40, 24, 64, 8, CASES["top1-e4"].tiles),
}


@pytest.fixture
def native() -> NativeMoe:
    routine = load_native_moe()
    if routine is None:
        pytest.skip("the compiled MoE experts could not be built here")
    return routine


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Each call builds or refuses anew, into a private cache."""
    monkeypatch.setenv(moe_cpu.CACHE_ENV, str(tmp_path))
    load_native_moe.cache_clear()
    yield
    load_native_moe.cache_clear()


@needs_cc
@pytest.mark.parametrize("case", [*FLOAT32_CASES.values(), *WIDE_CASES.values()],
                         ids=[*FLOAT32_CASES, *WIDE_CASES])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_the_reference(native: NativeMoe, case: Case, threads: int) -> None:
    inputs = make_inputs(case)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native(*inputs)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, fused_moe_ref(*inputs), rtol=2e-5, atol=2e-5)


@needs_cc
def test_strided_rows_int32_ids_and_no_tokens(native: NativeMoe) -> None:
    hidden, w_gate_up, w_down, weights, ids = make_inputs(WIDE_CASES["odd-widths-e5-top3"])
    wide = torch.cat([hidden, torch.full_like(hidden, float("nan"))], dim=1)[:, : hidden.shape[1]]  # row stride 2H
    torch.testing.assert_close(native(wide, w_gate_up, w_down, weights, ids.int()),
                               fused_moe_ref(hidden, w_gate_up, w_down, weights, ids), rtol=2e-5, atol=2e-5)
    assert native(hidden[:0], w_gate_up, w_down, weights[:0], ids[:0]).shape == (0, hidden.shape[1])


@needs_cc
def test_bad_inputs_are_refused_naming_them(native: NativeMoe) -> None:
    hidden, w_gate_up, w_down, weights, ids = make_inputs(FLOAT32_CASES["top1-e4"])
    with pytest.raises(ValueError, match="outside \\[0, 4\\)"):
        native(hidden, w_gate_up, w_down, weights, ids + 4)
    with pytest.raises(ValueError, match="float32 CPU"):
        native(hidden.bfloat16(), w_gate_up.bfloat16(), w_down.bfloat16(), weights, ids)
    with pytest.raises(ValueError, match="w_down"):
        native(hidden, w_gate_up, w_down[:, :, :-1], weights, ids)


@needs_cc
def test_the_blocks_of_a_float32_cpu_model_run_it_on_weights_packed_once(
        native: NativeMoe, tiny_model_dir: Callable[[str], Path]) -> None:
    with LLM(str(tiny_model_dir("qwen2_moe")), dtype="float32") as llm:
        blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]
        w_gate_up, w_down = blocks[0].w_gate_up.clone(), blocks[0].w_down.clone()
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0.0))
    assert blocks and all(block._packed is not None for block in blocks)
    # The packed experts are the only copy left (kept beside them, a second copy doubled the experts' memory).
    assert all(block.w_gate_up.numel() == block.w_down.numel() == 0 for block in blocks)
    block = blocks[0]
    hidden = torch.randn(7, w_gate_up.shape[2], generator=torch.Generator().manual_seed(0))
    weights, ids = block.route(hidden)
    torch.testing.assert_close(native.run(hidden, block._packed, weights, ids),
                               fused_moe_ref(hidden, w_gate_up, w_down, weights, ids), rtol=2e-5, atol=2e-5)


@needs_cc
def test_it_builds_once_and_is_reused(fresh_load: None, tmp_path: Path) -> None:
    assert load_native_moe() is not None
    [built] = tmp_path.glob("moe_experts-*.so")
    load_native_moe.cache_clear()
    assert load_native_moe() is not None
    assert list(tmp_path.glob("moe_experts-*.so")) == [built]


def test_switched_off_the_reference_runs(fresh_load: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(moe_cpu.SWITCH_ENV, "0")
    assert load_native_moe() is None
    assert not list(tmp_path.iterdir())


def test_without_a_compiler_it_says_why(fresh_load: None, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger=moe_cpu.__name__):
        assert load_native_moe() is None
    assert "MoE experts run the slower plain-torch path" in caplog.text


@pytest.fixture
def onednn_bf16() -> None:
    if packed_linear_choice(torch.bfloat16, torch.device("cpu")) != "onednn":
        pytest.skip("bf16 linears take no oneDNN packing on this CPU or torch build")


@pytest.mark.parametrize("case", [*CASES.values(), *WIDE_CASES.values()], ids=[*CASES, *WIDE_CASES])
def test_bf16_experts_on_packed_weights_give_the_references_bits(onednn_bf16: None, case: Case) -> None:
    hidden, w_gate_up, w_down, weights, ids = (t.bfloat16() if t.is_floating_point() else t for t in make_inputs(case))
    experts = OneDnnExperts(w_gate_up, w_down)
    assert torch.equal(experts(hidden, weights, ids), fused_moe_ref(hidden, w_gate_up, w_down, weights, ids))


def test_bf16_experts_refuse_ids_and_routings_that_do_not_fit(onednn_bf16: None) -> None:
    hidden, w_gate_up, w_down, weights, ids = (t.bfloat16() if t.is_floating_point() else t
                                               for t in make_inputs(FLOAT32_CASES["top1-e4"]))
    experts = OneDnnExperts(w_gate_up, w_down)
    with pytest.raises(ValueError, match="outside \\[0, 4\\)"):
        experts(hidden, weights, ids + 4)
    with pytest.raises(ValueError, match="do not route hidden"):
        experts(hidden[1:], weights, ids)
    assert experts(hidden[:0], weights[:0], ids[:0]).shape == (0, hidden.shape[1])


def test_without_the_compiled_bf16_routine_the_blocks_run_their_experts_on_onednn(
        onednn_bf16: None, tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(moe_cpu.SWITCH_ENV, "0")  # as on a CPU without avx512_bf16, or with no compiler
    load_native_moe_bf16.cache_clear()
    try:
        with LLM(str(tiny_model_dir("qwen2_moe")), dtype="bfloat16") as llm:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0.0))
            blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]
    finally:
        load_native_moe_bf16.cache_clear()
    assert blocks and all(block._onednn is not None and block._bf16 is None for block in blocks)
    # The packed experts are the only copy left.
    assert all(block.w_gate_up.numel() == block.w_down.numel() == 0 for block in blocks)
