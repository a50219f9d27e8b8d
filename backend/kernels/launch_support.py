"""Shared by the Triton-lang kernel launchers: input checks and picking compiled vs interpreted.

``triton.jit`` decides at decoration time, from ``TRITON_INTERPRET``, whether a
kernel is compiled or interpreted; triton's own library functions decide when
``triton`` is first imported (transformers imports it early through
``torch._dynamo``). So the launchers do not depend on that variable: CPU tensors
always go to an interpreted twin of the kernel, CUDA tensors to the kernel as
decorated. The kernels call only builtins, so either form runs them.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def is_interpreted(kernel: object) -> bool:
    """Whether this kernel object runs in the CPU interpreter rather than compiled."""
    return isinstance(kernel, InterpretedFunction)


def runnable(kernel: Any, device: torch.device) -> Any:
    """The kernel to launch for tensors on ``device``: the interpreter unless on CUDA."""
    if device.type == "cuda" or is_interpreted(kernel):
        return kernel
    return _interpreted(kernel.fn)


@functools.cache
def _interpreted(fn: Callable[..., None]) -> InterpretedFunction:
    return InterpretedFunction(fn)


def require_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected {device}")


def require_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in allowed)
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected one of {names}")


def require_ndim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter runs programs one at a time."""
    if device.type == "cuda":
        return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)
    return 1


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
