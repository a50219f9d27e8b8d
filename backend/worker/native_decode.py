"""The compiled paged decode attention (``paged_decode.c``), built once per machine and loaded with ctypes.

Decode attention is the one place where plain torch cannot avoid copying: SDPA
needs each sequence's K/V contiguous, so the torch path gathers every block of
every decoding sequence into a buffer, in every layer, and then reads it again.
The C routine reads the blocks where they lie, once. It is compiled with the
machine's own C compiler (``$CC``, else ``cc``) on first use, in about a second,
into ``~/.cache/pagedllm/native`` (``$PAGEDLLM_NATIVE_CACHE`` overrides it), keyed by
the source, the flags, the compiler and the CPU, so a shared home directory never
loads a library built for another CPU. No torch headers are involved, which is
why it builds in a second and not the ~35 s a torch C++ extension takes.

Without a compiler, or with ``PAGEDLLM_NATIVE_ATTENTION=0``, :func:`load_native_decode`
returns ``None`` and the plain-torch path runs instead, with a warning saying why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedllm.worker.cpu_attention_plan import NativeDecodes

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
SWITCH_ENV = "PAGEDLLM_NATIVE_ATTENTION"  # "0": never build or load it
CACHE_ENV = "PAGEDLLM_NATIVE_CACHE"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 120


class NativeDecode:
    """``pagedllm_paged_decode_f32`` with its argument types; see ``paged_decode.c`` for the contract."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._function = library.pagedllm_paged_decode_f32
        self._function.restype = ctypes.c_int
        self._function.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, pointer, i64, i64, i64, i64, i64,
                                   i64, ctypes.c_float, i64, ctypes.c_int, pointer, pointer]

    def __call__(
        self,
        q: torch.Tensor,  # float32 contiguous [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # float32 contiguous head-major [kv_heads, num_blocks, block_size, head_dim]
        v_cache: torch.Tensor,
        decodes: NativeDecodes,
        scale: float,
        out: torch.Tensor,  # float32 contiguous, q's shape: the decodes' rows are written
        lse: torch.Tensor,  # float32 contiguous [num_tokens, num_heads]: the decodes' rows are written
    ) -> None:
        kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        # C does not bound-check: a bad table would read outside the cache instead of raising.
        if decodes.lowest_block < 0 or decodes.highest_block >= num_blocks:
            raise ValueError(f"block table holds ids outside [0, {num_blocks})")
        failed = self._function(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), decodes.rows.ctypes.data,
            decodes.block_table.ctypes.data, decodes.block_table.shape[1], decodes.lens.ctypes.data,
            len(decodes.rows), kv_heads, q.shape[1] // kv_heads, head_dim, num_blocks, block_size, scale,
            decodes.max_len, torch.get_num_threads(), out.data_ptr(), lse.data_ptr(),
        )
        if failed:
            raise MemoryError(f"paged decode attention could not allocate {4 * q.shape[1] * decodes.max_len} bytes "
                              "of scratch space")


@functools.cache
def load_native_decode() -> NativeDecode | None:
    """The compiled routine, built on first call; ``None`` (with one warning) when it cannot be."""
    if os.environ.get(SWITCH_ENV) == "0":
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        logger.warning("no C compiler (%r) found: CPU decode attention runs the slower plain-torch path", compiler)
        return None
    try:
        return NativeDecode(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("building %s failed, so CPU decode attention runs the slower plain-torch path: %s",
                       SOURCE.name, error)
        return None


def _build(compiler: str) -> Path:
    """The library for this source, flags, compiler and CPU, compiled unless already cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedllm" / "native")
    target = cache / f"paged_decode-{key}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so that a concurrent process never loads half a file.
    with tempfile.TemporaryDirectory(dir=cache) as staging:
        built = Path(staging) / target.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True,
                                text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise OSError(f"{compiler} exited with {result.returncode}: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def _cpu() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))
