"""The compiled bf16 CPU MoE experts (moe_experts_bf16.c) against the float32 reference on the same bf16 inputs,
with each kernel this CPU offers; how they refuse bad input; and that a bf16 CPU model's MoE blocks run them.

The routine accumulates in float32 and rounds to bf16 twice (the activations, the output), where the bf16
reference rounds after every op, so it is not bit-identical to the reference: it is held to the float32 result
within ``TOLERANCE`` of the output's largest magnitude, and to be no farther from it than the bf16 reference.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.fused_moe_reference import fused_moe_ref
from pagedllm.layers.moe import SparseMoeBlock
from pagedllm.layers import moe_bf16
from pagedllm.layers.moe_bf16 import Bf16Experts, NativeMoeBf16, load_native_moe_bf16, pack_tiles
from pagedllm.layers.moe_cpu import SWITCH_ENV
from pagedllm.platform.native_build import CACHE_ENV, load_library

from test_fused_moe import CASES, Case, make_inputs
from test_moe_cpu import WIDE_CASES

TOLERANCE = 2**-7  # one bf16 step at the output's largest magnitude
# The checkpoint shape of qwen3-moe-0.3b (hidden 1024, 16 experts of 512, top-4): a decode step, a prefill chunk.
REAL_CASES = {
    "real-16-tokens": Case(16, 1024, 512, 16, 4, CASES["top1-e4"].tiles),
    "real-300-tokens": Case(300, 1024, 512, 16, 4, CASES["top1-e4"].tiles),
}
ALL_CASES = {**CASES, **WIDE_CASES, **REAL_CASES}


@pytest.fixture(scope="module")
def routine() -> NativeMoeBf16:
    loaded = load_native_moe_bf16()
    if loaded is None:
        pytest.skip("the compiled bf16 MoE experts cannot run here (no compiler or no avx512_bf16)")
    return loaded


def bf16_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    return tuple(t.bfloat16() if t.is_floating_point() else t for t in make_inputs(case))


@pytest.mark.parametrize("case", ALL_CASES.values(), ids=ALL_CASES.keys())
@pytest.mark.parametrize("threads", [1, 2])
def test_within_bf16_rounding_of_float32_and_no_farther_than_the_reference(routine: NativeMoeBf16, case: Case,
                                                                            threads: int) -> None:
    hidden, w_gate_up, w_down, weights, ids = bf16_inputs(case)
    exact = fused_moe_ref(hidden.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
    reference_error = (fused_moe_ref(hidden, w_gate_up, w_down, weights, ids).float() - exact).abs().max()
    experts = Bf16Experts(routine, w_gate_up, w_down)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outputs = {kernel: experts(hidden, weights, ids, kernel) for kernel in sorted(routine.kernels)}
    finally:
        torch.set_num_threads(previous)
    for kernel, out in outputs.items():
        assert out.dtype == torch.bfloat16 and out.shape == hidden.shape
        error = (out.float() - exact).abs().max()
        assert error <= TOLERANCE * exact.abs().max(), f"{kernel}: {error} at scale {exact.abs().max()}"
        assert error <= reference_error, f"{kernel}: {error} against the bf16 reference's {reference_error}"


def test_strided_rows_int32_ids_and_no_tokens(routine: NativeMoeBf16) -> None:
    hidden, w_gate_up, w_down, weights, ids = bf16_inputs(WIDE_CASES["odd-widths-e5-top3"])
    experts = Bf16Experts(routine, w_gate_up, w_down)
    wide = torch.cat((hidden, hidden), dim=1)[:, : hidden.shape[1]]  # rows a stride apart
    assert torch.equal(experts(wide, weights, ids.to(torch.int32)), experts(hidden, weights, ids))
    assert experts(hidden[:0], weights[:0], ids[:0]).shape == (0, hidden.shape[1])


def test_bad_inputs_are_refused_naming_them(routine: NativeMoeBf16) -> None:
    hidden, w_gate_up, w_down, weights, ids = bf16_inputs(CASES["top1-e4"])
    experts = Bf16Experts(routine, w_gate_up, w_down)
    with pytest.raises(ValueError, match="outside \\[0, 4\\)"):
        experts(hidden, weights, ids + 4)
    with pytest.raises(ValueError, match="do not fit bf16"):
        experts(hidden[1:], weights, ids)
    with pytest.raises(ValueError, match="do not fit bf16"):
        experts(hidden.float(), weights, ids)
    with pytest.raises(ValueError, match="kernel 'sse'"):
        experts(hidden, weights, ids, "sse")
    with pytest.raises(ValueError, match="bf16 weights"):
        Bf16Experts(routine, w_gate_up.float(), w_down)


def test_tiles_hold_16_outputs_by_input_pairs() -> None:
    weight = torch.arange(1 * 20 * 40, dtype=torch.float32).reshape(1, 20, 40)
    tiles = pack_tiles(weight, 32, 64)  # padded to 2 blocks of 16 outputs, 2 tiles of 32 inputs
    assert tiles.shape == (1, 2, 2, 512)
    # Tile (block 1, inputs 32-63), row 3 (inputs 38, 39), output 2 of the block (row 18 of the weight).
    row = tiles[0, 1, 1].view(16, 16, 2)[3, 2]
    assert row.tolist() == [weight[0, 18, 38].item(), weight[0, 18, 39].item()]
    assert tiles[0, 1, 1].view(16, 16, 2)[:, 4:].eq(0).all()  # outputs 20-31 are padding
    with pytest.raises(ValueError, match="cannot pad"):
        pack_tiles(weight, 24, 64)


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    load_native_moe_bf16.cache_clear()
    yield monkeypatch
    load_native_moe_bf16.cache_clear()


def test_switched_off_it_is_not_loaded(fresh_load: pytest.MonkeyPatch) -> None:
    fresh_load.setenv(SWITCH_ENV, "0")
    assert load_native_moe_bf16() is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_the_blocks_of_a_bf16_cpu_model_run_it_on_weights_packed_once(
        routine: NativeMoeBf16, tiny_model_dir: Callable[[str], Path], arch: str) -> None:
    with LLM(str(tiny_model_dir(arch)), dtype="bfloat16") as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0.0))
        blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(out[0].outputs[0].token_ids) == 4
    assert blocks and all(block._bf16 is not None and block._onednn is None for block in blocks)
    # The packed experts are the only copy left.
    assert all(block.w_gate_up.numel() == block.w_down.numel() == 0 for block in blocks)


def test_built_for_a_cpu_without_avx512_bf16_it_offers_no_kernel(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Such a build compiles (the routine is a stub there) and reports nothing, so the loader returns None and the
    block keeps its oneDNN experts."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    library = load_library(moe_bf16.SOURCE, SWITCH_ENV, "none", logging.getLogger(__name__),
                           ("-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16"))
    if library is None:
        pytest.skip("no C compiler here")
    assert library.pagedllm_moe_bf16_kernels() == 0
