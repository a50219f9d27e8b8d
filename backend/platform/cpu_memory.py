"""CPU memory: freed memory kept in the process, and huge pages for the big buffers that live as long as it.

glibc hands blocks above its mmap threshold back to the kernel when they are
freed, and trims the top of its heap above the trim threshold. A prefill step's
activations are megabytes each (the small benchmark model's 2048 x 3072 gate/up
output is 25 MB), so every step got them back as fresh pages, zeroed by the
kernel one 4 KB page fault at a time. Raising both thresholds keeps that memory
for the next step. Measured ad hoc on an AMD EPYC host, 1 thread: RMSNorm over
2048 x 512 floats 4.2 -> 0.40 ms, SiLU(gate) * up over 2048 x 1536 15 -> 3.4 ms;
small long-tail end to end 21.3 -> 19.9 s, tiny shared-prefix 5.5 -> 4.9 s. On
an Intel Xeon host (2026-12-01, with the fused elementwise routines) it was
within noise: 15.6-15.7 against 15.7-16.4 s, 3.43-3.45 against 3.39-3.51 s.
The cost is that the process keeps its peak working set, which a serving process
does anyway.
TCMalloc, which vLLM's CPU guide preloads, gets the same effect another way.

The two big long-lived buffers, the KV cache and the packed weights, are also
asked for transparent huge pages (:func:`advise_huge_pages`). Hosts that
leave THP at ``madvise`` (the common default, and this project's CPU host)
otherwise back them with 4 KB pages: a decode step reads the cache in scattered
4 KB blocks, each on a page of its own, and streams every weight once, so it
pays a TLB miss per page. On the project's Xeon host, 1 thread, a decode step's
attention over blocks scattered in a 128 MB cache, CPU caches flushed before each
call: 1.11-1.22x faster at 2-32 sequences (``scripts/ab_cpu_choices.py --only
huge-pages``); the small benchmark model's 33 packed linears at 2-32 rows
1.01-1.05x (ad hoc).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit hosts; blocks above it are still mapped one by one.
MAX_MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
MADV_HUGEPAGE = 14  # Linux <sys/mman.h>
PAGE_SIZE = 4096


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; ``False`` where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.info("no glibc mallopt here: freed CPU memory goes back to the system as before")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success.
    return bool(mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back ``tensor``'s whole pages with transparent huge pages; ``False`` where it cannot.

    It takes effect on pages first touched after the call (earlier ones wait for
    khugepaged), so call it on a fresh ``torch.empty`` before filling it. Only
    advice: the contents and every result stay the same.
    """
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    start = tensor.data_ptr()
    first = -(-start // PAGE_SIZE) * PAGE_SIZE  # madvise takes whole pages
    end = (start + tensor.numel() * tensor.element_size()) // PAGE_SIZE * PAGE_SIZE
    # 0 on success; EINVAL where the kernel has no transparent huge pages.
    return end > first and madvise(first, end - first, MADV_HUGEPAGE) == 0


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL("libc.so.6").madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise
