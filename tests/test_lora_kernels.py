"""The Triton-lang LoRA shrink/expand kernels against their plain-torch references, in the interpreter.

Segments come from the engine's own grouping (``build_lora_mapping``): random per-sequence slots, base-only tokens
(never written), an adapter slot with no token in the step, ranks 4-64.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kernels.lora_reference import lora_expand_ref, lora_shrink_ref
from pagedllm.kernels.lora_sgmv import lora_expand, lora_shrink
from pagedllm.lora.mapping import build_lora_mapping
from pagedllm.lora.slots import BASE_SLOT

NUM_SLOTS = 4


def random_mapping(seed: int, num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    query_lens = rng.integers(1, 9, num_seqs)
    # Slot NUM_SLOTS - 1 is loaded but no sequence uses it this step.
    seq_slots = rng.choice([BASE_SLOT, *range(NUM_SLOTS - 1)], num_seqs)
    seq_slots[0] = 0
    seq_slots[-1] = BASE_SLOT
    return seq_slots, query_lens


@pytest.mark.parametrize(("rank", "in_features", "out_features", "seed"),
                         [(4, 40, 24, 0), (16, 64, 48, 1), (64, 33, 70, 2)])
def test_shrink_and_expand_match_reference(rank: int, in_features: int, out_features: int, seed: int) -> None:
    seq_slots, query_lens = random_mapping(seed, num_seqs=7)
    mapping = build_lora_mapping(seq_slots, query_lens, torch.device("cpu"))
    assert mapping is not None and NUM_SLOTS - 1 not in mapping.seg_slots.tolist()
    num_tokens = int(query_lens.sum())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=g)
    lora_a = torch.randn(NUM_SLOTS, rank, in_features, generator=g)
    lora_b = torch.randn(NUM_SLOTS, out_features, rank, generator=g)
    segments = (mapping.token_indices, mapping.seg_starts, mapping.seg_slots, mapping.max_seg_len)

    sentinel = 12345.0  # base rows of the shrink buffer are never written
    got, want = torch.full((num_tokens, rank), sentinel), torch.full((num_tokens, rank), sentinel)
    lora_shrink(x, lora_a, got, *segments)
    lora_shrink_ref(x, lora_a, want, *segments)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = torch.from_numpy(np.repeat(seq_slots, query_lens) == BASE_SLOT)
    assert bool((got[base] == sentinel).all())

    y = torch.randn(num_tokens, out_features, generator=g)
    got_y, want_y = y.clone(), y.clone()
    lora_expand(want, lora_b, got_y, *segments)
    lora_expand_ref(want, lora_b, want_y, *segments)
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-4)
    assert torch.equal(got_y[base], y[base])  # base-only tokens skip the adapter
    assert not torch.equal(got_y[~base], y[~base])


def test_bfloat16_output_accumulates_in_float32() -> None:
    seq_slots, query_lens = np.array([1, BASE_SLOT, 1, 0]), np.array([3, 2, 17, 1])
    mapping = build_lora_mapping(seq_slots, query_lens, torch.device("cpu"))
    assert mapping is not None
    assert [(span.slot, span.stop - span.start) for span in mapping.spans] == [(0, 1), (1, 20)]
    assert mapping.rows.tolist() == [22, 0, 1, 2, *range(5, 22)]
    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(23, 8, generator=g)
    lora_b = torch.randn(2, 32, 8, generator=g).bfloat16()
    y = torch.randn(23, 32, generator=g).bfloat16()
    got, want = y.clone(), y.clone()
    segments = (mapping.token_indices, mapping.seg_starts, mapping.seg_slots, mapping.max_seg_len)
    lora_expand(buffer, lora_b, got, *segments)
    lora_expand_ref(buffer, lora_b, want, *segments)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_base_only_step_has_no_mapping() -> None:
    assert build_lora_mapping(np.array([BASE_SLOT, BASE_SLOT]), np.array([4, 1]), torch.device("cpu")) is None


def test_kernel_refuses_shapes_that_do_not_chain() -> None:
    mapping = build_lora_mapping(np.array([0]), np.array([2]), torch.device("cpu"))
    assert mapping is not None
    with pytest.raises(ValueError, match="shapes do not chain"):
        lora_shrink(torch.zeros(2, 8), torch.zeros(1, 4, 9), torch.zeros(2, 4), mapping.token_indices,
                    mapping.seg_starts, mapping.seg_slots, mapping.max_seg_len)


def test_adapted_linear_kernel_path_equals_cpu_path() -> None:
    """The fused q|k|v layout (three parts, block-diagonal B) through both backends' reading of one mapping."""
    from torch import nn

    from pagedllm.lora.linear import LoRAContext, LoRALinear

    g = torch.Generator().manual_seed(5)
    base = nn.Linear(32, 48, bias=True)
    context = LoRAContext()
    linear = LoRALinear(base, (16, 16, 16), max_loras=3, max_rank=8, context=context, dtype=torch.float32,
                        device=torch.device("cpu"))
    for slot, rank in enumerate((8, 4, 2)):
        parts = [(torch.randn(rank, 32, generator=g), torch.randn(16, rank, generator=g)) if keep else None
                 for keep in (True, slot != 1, True)]
        linear.set_slot(slot, parts, scale=0.5 + slot)
    seq_slots, query_lens = np.array([2, BASE_SLOT, 0, 1, 0]), np.array([3, 2, 1, 4, 2])
    x = torch.randn(int(query_lens.sum()), 32, generator=g)
    with torch.no_grad():
        plain = base(x)
        context.mapping = build_lora_mapping(seq_slots, query_lens, torch.device("cpu"))
        cpu = linear(x)
        linear.use_kernels = True  # the CUDA path, run by triton's interpreter
        kernels = linear(x)
    torch.testing.assert_close(kernels, cpu, rtol=1e-5, atol=1e-5)
    base_rows = torch.from_numpy(np.repeat(seq_slots, query_lens) == BASE_SLOT)
    assert torch.equal(cpu[base_rows], plain[base_rows])
    # Slot 0's adapter by hand: y += scale * x A^T B^T per part.
    rows = torch.from_numpy(np.repeat(seq_slots, query_lens) == 0)
    a, b = linear.lora_a[0], linear.lora_b[0]
    torch.testing.assert_close(cpu[rows], plain[rows] + (x[rows] @ a.T) @ b.T, rtol=1e-5, atol=1e-5)
