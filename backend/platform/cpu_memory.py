"""CPU memory: freed memory kept in the process, and huge pages for the big buffers that live as long as it.

glibc hands blocks above its mmap threshold back to the kernel when they are
freed, and trims the top of its heap above the trim threshold. A prefill step's
activations are megabytes each (the small benchmark model's 2048 x 3072 gate/up
output is 25 MB), so every step got them back as fresh pages, zeroed by the
kernel one 4 KB page fault at a time. Raising both thresholds keeps that memory
for the next step: elementwise steps over fresh buffers ran several times slower
than over reused ones, and whole workloads gained where page faults were a visible
share of the step (within noise where fused elementwise routines had already cut
those buffers; measured: RESULTS.md, "Figures behind the code's choices").
The cost is that the process keeps its peak working set, which a serving process
does anyway.
TCMalloc, which vLLM's CPU guide preloads, gets the same effect another way.

The two big long-lived buffers, the KV cache and the packed weights, are also
asked for transparent huge pages (:func:`advise_huge_pages`). Hosts that
leave THP at ``madvise`` (the common default, and this project's CPU host)
otherwise back them with 4 KB pages: a decode step reads the cache in scattered
4 KB blocks, each on a page of its own, and streams every weight once, so it
pays a TLB miss per page. Huge pages speed up the scattered reads of a decode
step's attention and, a little, the weight streaming of the packed linears
(``scripts/ab_cpu_choices.py --only huge-pages``; measured: RESULTS.md,
"Figures behind the code's choices").
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
