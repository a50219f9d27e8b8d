"""Checks shared by the Triton-lang kernel launchers: devices, dtypes, the interpreter."""
from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

INTERPRETER_HINT = "set TRITON_INTERPRET=1 before pagedllm.kernels loads its Triton modules to run them on CPU"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def is_interpreted(kernel: object) -> bool:
    """Whether ``triton.jit`` built this kernel for the CPU interpreter (decided at import)."""
    return isinstance(kernel, InterpretedFunction)


def require_runnable(kernel: object, device: torch.device) -> None:
    """Compiled kernels need CUDA; on CPU only the interpreter can run them."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(f"Triton kernels got {device.type} tensors: {INTERPRETER_HINT}")


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
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
