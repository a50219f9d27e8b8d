"""After keep_freed_memory, a step's large temporaries stay in the process when freed, instead of being
handed back to the kernel and faulted in again, page by page, in the next step."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Run in a fresh interpreter each time, with and without the call. What the process holds is
# mallinfo2's arena (heap) plus hblkhd (blocks mapped one by one). glibc's defaults map large
# blocks alone and unmap them on free, and trim a freed heap top above a (dynamic, <= 64 MB)
# threshold; a prefill step frees more than that.
MEASURE = """
import ctypes, json, sys, torch
from pagedllm.platform.cpu_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
size = 24 << 20  # about a prefill step's gate/up output for the small benchmark model
held = lambda: mallinfo2().arena + mallinfo2().hblkhd
step = [torch.ones(size // 4) for _ in range(8)]
holding = held()
del step
print(json.dumps({"kept": kept, "step": 8 * size, "holding": holding, "after_free": held()}))
"""


def measure(mode: str) -> dict[str, int]:
    return json.loads(subprocess.run([sys.executable, "-c", MEASURE, mode], capture_output=True, text=True,
                                     check=True, timeout=120).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steps_freed_activations_stay_in_the_process() -> None:
    default, kept = measure("default"), measure("keep")
    assert default["after_free"] < default["holding"] - default["step"] // 2  # the control: handed back
    assert kept["kept"]
    assert kept["holding"] >= kept["step"]
    assert kept["after_free"] == kept["holding"]


# The advised and the plain tensor's huge-page share, from the kernel's own accounting of their mappings.
HUGE_PAGES = """
import json, sys, torch
from pagedllm.platform.cpu_memory import advise_huge_pages

def huge_kb(tensor):
    # madvise splits the mapping at the advised pages, so sum every mapping that overlaps the tensor.
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low < end and start < high
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total

size = 64 << 20  # mapped on its own, untouched until filled
advised = torch.empty(size // 4)
accepted = advise_huge_pages(advised)
advised.fill_(1.5)
plain = torch.empty(size // 4).fill_(1.5)
# What the engine allocates through it: a KV cache and a packed weight, 64 MB each.
from pagedllm.layers.cpu_linear import MklPackedLinear, _mkl
from pagedllm.attention.cpu_attention import new_cpu_cache
cache = new_cpu_cache((2048, 16, 8, 64), torch.float32, torch.device("cpu")).permute(2, 0, 1, 3)
packed = MklPackedLinear(torch.ones(4096, 4096), None).packed if _mkl() is not None else None
print(json.dumps({"accepted": accepted, "advised_kb": huge_kb(advised), "plain_kb": huge_kb(plain),
                  "intact": bool(advised.eq(1.5).all()), "strided": advise_huge_pages(advised[::2]),
                  "cache_kb": huge_kb(cache), "packed_kb": None if packed is None else huge_kb(packed)}))
"""


def transparent_huge_pages() -> str | None:
    """The host's THP mode ("always", "madvise", "never"), or None without THP."""
    try:
        modes = open("/sys/kernel/mm/transparent_hugepage/enabled").read().split()
    except OSError:
        return None
    return next((mode.strip("[]") for mode in modes if mode.startswith("[")), None)


@pytest.mark.skipif(transparent_huge_pages() in (None, "never"), reason="no transparent huge pages on this host")
def test_advised_memory_is_backed_by_huge_pages() -> None:
    result = json.loads(subprocess.run([sys.executable, "-c", HUGE_PAGES], capture_output=True, text=True,
                                       check=True, timeout=120).stdout)
    assert result["accepted"] and result["intact"] and not result["strided"]
    assert result["advised_kb"] >= 32 << 10  # most of the 64 MB
    assert result["cache_kb"] >= 32 << 10
    assert result["packed_kb"] is None or result["packed_kb"] >= 32 << 10
    if transparent_huge_pages() == "madvise":  # the control: without the advice, 4 KB pages
        assert result["plain_kb"] == 0
