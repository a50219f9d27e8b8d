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
from pagedllm.worker.cpu_memory import keep_freed_memory

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
