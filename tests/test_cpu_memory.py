"""After keep_freed_memory, a step's large temporaries reuse the pages the last step freed."""
from __future__ import annotations

import resource
import sys

import pytest
import torch

from pagedllm.worker.cpu_memory import keep_freed_memory

PAGE = 4096


def faults_while_touching(num_bytes: int) -> int:
    """Minor page faults taken while a fresh tensor of ``num_bytes`` is allocated and written."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor = torch.ones(num_bytes // 4, dtype=torch.float32)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del tensor
    return after - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_activation_sized_block_is_reused_without_page_faults() -> None:
    assert keep_freed_memory()
    size = 24 << 20  # about a prefill step's gate/up output for the small benchmark model
    for _ in range(2):  # the first allocations grow the heap and fault its pages in
        faults_while_touching(size)
    repeats = [faults_while_touching(size) for _ in range(6)]
    # Without the thresholds every repeat faults every page again (6,144 of them). With them, a
    # repeat may still grow the heap once when something else took part of the freed block.
    assert sum(faults < size // PAGE // 20 for faults in repeats) >= 4, repeats
