"""CPU prefill attention, side by side: the compiled routine that reads K/V in place against gather + SDPA.

Printed by ``pagedllm bench kernels`` on CPU, at 1 thread unless the caller set
otherwise. One prefill chunk per row, ``query`` new tokens after ``context``
cached ones, in the tiny and small checkpoints' head layouts, block 16. Both
sides run from one step plan (planned once, as in a step); "SDPA path" is the
production backend's torch path (the chunk's blocks gathered, a mask built
for a chunk after cached context, one SDPA), "compiled" is
:mod:`pagedllm.attention.native_prefill` forced on the chunk, and "rule" says which
one :func:`pagedllm.attention.cpu_attention_plan.native_prefill_wins` picks. This
table is where that rule's numbers come from.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedllm_bench.cpu_attention import HEAD_LAYOUTS, interleaved, metadata_of, relative_error
from pagedllm.kernels.reference import unified_attention_ref
from pagedllm.testing.paged_batch import random_paged_batch
from pagedllm.attention.cpu_attention import CpuPagedAttention, new_cpu_cache
from pagedllm.attention.cpu_attention_plan import CpuAttentionPlan, native_prefill_wins, native_prefills, plan_cpu_attention
from pagedllm.attention.native_prefill import load_native_prefill

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class PrefillRow:
    shape: str
    query_len: int
    context: int  # cached tokens before the chunk
    sdpa_ms: float
    compiled_ms: float
    rule: str  # what the plan picks: "compiled" or "sdpa"
    max_error: float  # compiled vs the reference, relative to the reference's largest magnitude

    @property
    def speedup(self) -> float:
        return self.sdpa_ms / self.compiled_ms


def prefill_rows(sizes: Sequence[str], query_lens: Sequence[int], contexts: Sequence[int], reps: int) -> list[PrefillRow]:
    """One row per (head layout, query length, context); empty when the routine does not build here."""
    native = load_native_prefill()
    if native is None:
        print("CPU prefill attention: the compiled routine did not build here (see the warning above)\n")
        return []
    rows = []
    generator = torch.Generator().manual_seed(2)
    torch_path = CpuPagedAttention()
    for size, num_heads, num_kv_heads, head_dim in HEAD_LAYOUTS:
        if size not in sizes:
            continue
        for context in contexts:
            for query_len in query_lens:
                batch = random_paged_batch([query_len], [context + query_len], num_heads, num_kv_heads, head_dim,
                                           BLOCK_SIZE, generator=generator)
                k_cache, v_cache = (new_cpu_cache(tuple(c.shape), c.dtype, c.device).copy_(c)
                                    for c in (batch.k_cache, batch.v_cache))
                planned = plan_cpu_attention(metadata_of(batch))
                plan = planned.plan
                if not isinstance(plan, CpuAttentionPlan):
                    raise TypeError("plan_cpu_attention returned no CpuAttentionPlan")
                chunks = native_prefills(plan, np.array([0]), BLOCK_SIZE)
                heads_first = (k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3))

                def compiled() -> torch.Tensor:
                    out = torch.empty_like(batch.q)
                    native(batch.q, *heads_first, chunks, batch.scale, out)
                    return out

                def sdpa() -> torch.Tensor:
                    return torch_path.attend(batch.q, k_cache, v_cache, planned, batch.scale)

                times = interleaved({"sdpa": sdpa, "compiled": compiled}, reps)
                expected = unified_attention_ref(*replace(batch, k_cache=k_cache, v_cache=v_cache).args())
                wins = native_prefill_wins(query_len, context + query_len, native.wide)
                rows.append(PrefillRow(f"{size} heads {num_heads}/{num_kv_heads}", query_len, context, times["sdpa"],
                                       times["compiled"], "compiled" if wins else "sdpa",
                                       relative_error(compiled(), expected)))
    return rows


def print_rows(rows: Sequence[PrefillRow]) -> None:
    print(f"CPU prefill attention, one chunk per layer ({torch.get_num_threads()} thread(s), block {BLOCK_SIZE}): "
          "compiled = pagedllm.attention.native_prefill reading K/V in place, SDPA path = gather + mask + SDPA\n")
    print("| heads | query | context | SDPA path ms | compiled ms | compiled speed-up | rule picks | max rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.shape} | {row.query_len} | {row.context} | {row.sdpa_ms:.3f} | {row.compiled_ms:.3f} "
              f"| {row.speedup:.2f}x | {row.rule} | {row.max_error:.1e} |")
    print()
