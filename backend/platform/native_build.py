"""Compiling the package's small C sources on the serving machine, once, and loading them with ctypes.

Each source is compiled with the machine's own C compiler (``$CC``, else ``cc``)
on first use, in about a second, into ``~/.cache/pagedllm/native``
(``$PAGEDLLM_NATIVE_CACHE`` overrides it), keyed by the source, the flags, the
compiler and the CPU, so a shared home directory never loads a library built
for another CPU. No torch headers are involved, which is why a build takes a
second and not the ~35 s a torch C++ extension takes.

``-ffast-math`` is never used: on gcc < 13 it links crtfastmath.o, which flips
the whole process to flush-to-zero when the library is loaded.
``-fno-trapping-math`` is: it changes no value, only lets gcc assume nobody reads
the floating-point exception flags. Without it, gcc 12 on an AVX2-only CPU keeps a
select such as ``x < c ? c : x`` a branch, which leaves its loop scalar (AVX-512's
masked moves vectorize it either way): SiLU-and-multiply and the decode routine's
softmax ran one element at a time on such CPUs.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE_ENV = "PAGEDLLM_NATIVE_CACHE"
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 120


def load_library(source: Path, switch_env: str | None, fallback: str, log: logging.Logger,
                 extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """``source`` compiled and loaded, or ``None``: when ``switch_env`` (if any) is "0" (silently), or with one
    warning on ``log`` that ends with ``fallback`` (what runs instead) when no compiler builds it."""
    if switch_env is not None and os.environ.get(switch_env) == "0":
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("no C compiler (%r) found: %s", compiler, fallback)
        return None
    try:
        return ctypes.CDLL(str(_build(source, compiler, FLAGS + extra_flags)))
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("building %s failed, so %s: %s", source.name, fallback, error)
        return None


def _build(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    """The library for this source (with the headers it includes), flags, compiler and CPU, compiled unless
    already cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    text = source.read_text()
    headers = [(source.parent / name).read_text() for name in re.findall(r'^#include "([^"]+)"', text, re.MULTILINE)]
    key = hashlib.sha256("\n".join([text, *headers, " ".join(flags), version, _cpu()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedllm" / "native")
    target = cache / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so that a concurrent process never loads half a file.
    with tempfile.TemporaryDirectory(dir=cache) as staging:
        built = Path(staging) / target.name
        result = subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], capture_output=True,
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
