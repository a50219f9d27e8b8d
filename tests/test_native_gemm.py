"""The native float32 GEMM (packed_gemm_f32.c) through NativeLinear, the class the models' linears load as."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_linear import NativeLinear, packed_linear_choice
from pagedllm.layers.native_gemm import load_native_gemm

pytestmark = pytest.mark.skipif(load_native_gemm() is None, reason="the native float32 GEMM does not build here")


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()


# Rows on both sides of the 6-row tile and of the small-row order's 64, and every row count that runs panels side
# by side; features on both sides of the 256-long k chunk; outputs on both sides of the 16-column panel, and
# with whole groups of side-by-side panels before a short last group (200 columns: 12 panels and a partial one).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 64, 65, 200])
@pytest.mark.parametrize(("in_features", "out_features"),
                         [(1, 1), (7, 15), (256, 16), (300, 17), (513, 70), (300, 200)])
def test_products_match_float64(rows: int, in_features: int, out_features: int, two_threads: None) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    linear = NativeLinear(weight, bias)
    torch.testing.assert_close(linear(x), reference(x, weight, bias), rtol=1e-5, atol=1e-5 * in_features**0.5)
    assert torch.equal(linear.unpacked_weight(), weight)


def test_a_row_comes_out_the_same_in_any_batch_and_with_any_thread_count() -> None:
    """Each output is one sum in a fixed order, whichever loop order the row count picks and however many threads
    split the columns: a request's logits do not depend on what it is batched with."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(100, 700, generator=generator)
    x = torch.randn(150, 700, generator=generator)
    linear = NativeLinear(weight, None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = linear(x)
        torch.set_num_threads(1)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(0, 150, 37)])
        assert torch.equal(linear(x), batched)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, batched[0:150:37])
    assert torch.equal(linear(x[:40]), batched[:40])  # the small-row order against the large-row one
    for rows in range(1, 7):  # each side-by-side panel tile, and the register tile at 6
        assert torch.equal(linear(x[:rows]), batched[:rows])


def test_leading_dimensions_and_empty_input_keep_their_shape() -> None:
    linear = NativeLinear(torch.randn(24, 8), None)
    x = torch.randn(2, 3, 8)
    assert torch.equal(linear(x), torch.cat([linear(x[0]), linear(x[1])]).reshape(2, 3, 24))
    assert linear(torch.empty(0, 8)).shape == (0, 24)


def test_bad_input_is_refused_with_a_reason() -> None:
    linear = NativeLinear(torch.randn(24, 8), None)
    with pytest.raises(ValueError, match="takes float32 CPU input, got torch.float64"):
        linear(torch.ones(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="input has 9 features, the weight 8"):
        linear(torch.ones(3, 9))
    with pytest.raises(ValueError, match="cannot pack a torch.float16"):
        NativeLinear(torch.ones(24, 8, dtype=torch.float16), None)


def test_it_is_the_float32_default_only_on_cpus_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("PAGEDLLM_CPU_LINEAR", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    assert packed_linear_choice(torch.float32, cpu) == "native"
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    assert packed_linear_choice(torch.float32, cpu) == "onednn"
    monkeypatch.setenv("PAGEDLLM_CPU_LINEAR", "native")
    assert packed_linear_choice(torch.float32, cpu) == "native"
