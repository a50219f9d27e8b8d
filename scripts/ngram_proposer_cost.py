"""Host cost of the n-gram proposer per engine step: batch 64, context 4096, k = 4, median of 50 steps.

Each step appends one token to every sequence and proposes for all of them, as the engine does after a
decode step; the first call, which indexes the whole contexts once, is timed apart. Two vocabularies: 32,000 (random text: few candidate matches) and 64 (very repetitive: many).
Run: ``OMP_NUM_THREADS=1 .venv/bin/python scripts/ngram_proposer_cost.py``.
"""
from __future__ import annotations

import time

import numpy as np

from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.worker.ngram_proposer import NgramProposer

BATCH, CONTEXT, K, STEPS = 64, 4096, 4, 50


def main() -> None:
    rng = np.random.default_rng(0)
    for label, vocab in (("vocab 32000 (random text)", 32000), ("vocab 64 (highly repetitive)", 64)):
        seqs = []
        for index in range(BATCH):
            tokens = rng.integers(0, vocab, CONTEXT).tolist()
            seqs.append(Request(str(index), None, tuple(tokens), SamplingParams()).spawn(list(tokens)))
        for low, high in ((1, 3), (2, 5)):
            proposer = NgramProposer(K, low, high)
            started = time.perf_counter()
            proposer.propose(seqs, [2 * K] * BATCH)  # the first call indexes every context whole
            first = time.perf_counter() - started
            times = []
            for _ in range(STEPS):
                for seq in seqs:
                    seq.token_ids.append(int(rng.integers(0, vocab)))
                started = time.perf_counter()
                proposer.propose(seqs, [2 * K] * BATCH)
                times.append(time.perf_counter() - started)
            median = float(np.median(times))
            print(f"{label}, lookup {low}-{high}, k={K}: {median * 1e3:.2f} ms/step at batch {BATCH}, "
                  f"context {CONTEXT} ({median / BATCH * 1e6:.1f} us/seq); first call {first * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
