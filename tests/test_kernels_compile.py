"""The kernels compile for an H100/H200 (sm_90) with no GPU present.

The interpreter runs Python, so it cannot catch what only the compiler rejects
(types of loop-carried values, early returns, dot shapes, shared memory). Each
case records the launch a CPU call would make, specialises its arguments the
way triton's launcher does (ints equal to 1 become constants, multiples of 16
get divisibility hints), and compiles it to a cubin with the ptxas that ships
in the triton wheel. Uses triton's compiler entry points, so a triton upgrade
may need this file adjusted.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton.backends.nvidia")
try:
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # older triton specialises in Python; this check follows 3.9's launcher
    pytest.skip("needs the native launcher specialisation of triton 3.9", allow_module_level=True)

from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as compile_kernel  # noqa: E402

from pagedllm.kernels import attention_launch, block_copy, kv_write  # noqa: E402
from pagedllm.kernels.attention_kernel import unified_attention_kernel  # noqa: E402
from pagedllm.kernels.attention_tiles import HOPPER_TILES  # noqa: E402
from pagedllm.kernels.launch_support import is_interpreted  # noqa: E402

if is_interpreted(unified_attention_kernel):
    pytest.skip("TRITON_INTERPRET=1 made the kernels interpreter-only", allow_module_level=True)

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 227 * 1024  # per block on sm_90

Launch = tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Calls to the public functions record their launches instead of running them."""
    recorded: list[Launch] = []

    def recorder(kernel: Any, device: torch.device) -> Any:
        class Grid:
            def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
                return lambda *args, **kwargs: recorded.append((kernel, grid, args, kwargs))

        return Grid()

    for module in (attention_launch, kv_write, block_copy):
        monkeypatch.setattr(module, "runnable", recorder)
    monkeypatch.setattr(attention_launch, "is_interpreted", lambda kernel: False)
    return recorded


def _compile(launch: Launch) -> Any:
    kernel, _, args, kwargs = launch
    options = {"num_warps": kwargs.pop("num_warps", 4), "num_stages": kwargs.pop("num_stages", 3)}
    values = dict(zip(kernel.arg_names, args)) | kwargs
    signature: dict[str, str] = {}
    constants: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for index, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        if param.is_constexpr:
            signature[name], constants[(index,)] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            signature[name], constants[(index,)] = kind, spec
            continue
        signature[name] = "*bf16" if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else kind
        if spec:
            attrs[(index,)] = BaseBackend.parse_attr(spec)
    return compile_kernel(ASTSource(kernel, signature, constants, attrs), target=HOPPER, options=options)


def _attention(query_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, num_splits: int | None) -> None:
    width = -(-max(seq_lens) // 16)
    q = torch.empty(sum(query_lens), heads, head_dim, dtype=dtype)
    cache = torch.empty(width * len(seq_lens), 16, kv_heads, head_dim, dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    attention_launch.unified_attention_with_splits(
        q, cache, cache.clone(), starts, torch.tensor(seq_lens, dtype=torch.int32),
        torch.zeros(len(seq_lens), width, dtype=torch.int32), head_dim ** -0.5, num_splits=num_splits,
    )


ATTENTION_CASES = {
    "decode-bf16-gqa4-d128": ([1] * 8, [4096] * 8, 32, 8, 128, torch.bfloat16, 1),
    "decode-bf16-gqa8-d128-split": ([1, 1], [8192, 8192], 64, 8, 128, torch.bfloat16, 16),
    "prefill-bf16-gqa4-d128": ([1024], [1024], 32, 8, 128, torch.bfloat16, None),
    "mixed-fp16-gqa7-d80": ([1, 50], [300, 60], 14, 2, 80, torch.float16, None),
    "prefill-bf16-d256": ([100], [100], 8, 8, 256, torch.bfloat16, None),
    "prefill-fp32-d128": ([100], [100], 8, 2, 128, torch.float32, None),
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_attention_compiles_for_sm90(case: tuple[Any, ...], launches: list[Launch]) -> None:
    _attention(*case)
    expected = 2 if case[-1] not in (None, 1) else 1
    assert len(launches) == expected  # split-KV adds the reduce launch
    for launch in launches:
        assert _compile(launch).metadata.shared <= SHARED_MEMORY_LIMIT


def test_every_tile_table_entry_compiles_for_sm90(launches: list[Launch]) -> None:
    """Each family's tiles, warps and stages (backend/kernels/attention_tiles.py) fit an sm_90 block's shared memory."""
    head_dims = {64: 64, 128: 128, 256: 256}
    for family in HOPPER_TILES:
        dtype = torch.float32 if family.precision == "fp32" else torch.bfloat16
        query_lens, seq_lens = ([1] * 4, [2048] * 4) if family.phase == "decode" else ([512], [512])
        _attention(query_lens, seq_lens, 32, 8, head_dims[family.head_bucket], dtype, None)
    assert len(launches) == len(HOPPER_TILES)
    for launch, config in zip(launches, HOPPER_TILES.values()):
        assert (launch[3]["TILE_N"], launch[3]["num_warps"], launch[3]["num_stages"]) == (
            config.tile_n, config.num_warps, config.num_stages)
        assert _compile(launch).metadata.shared <= SHARED_MEMORY_LIMIT


def test_cache_kernels_compile_for_sm90(launches: list[Launch]) -> None:
    key = torch.empty(8, 8, 128, dtype=torch.bfloat16)
    cache = torch.empty(10, 16, 8, 128, dtype=torch.bfloat16)
    kv_write.write_kv(key, key, cache, cache.clone(), torch.arange(8))
    block_copy.copy_blocks([(cache, cache.clone())], torch.tensor([[0, 1]]))
    assert [launch[0].fn.__name__ for launch in launches] == ["write_kv_kernel", "copy_blocks_kernel"]
    for launch in launches:
        _compile(launch)
