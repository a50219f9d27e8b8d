"""The persistent input batch equals a from-scratch build of every step, through forks, copy-on-write,
preemption, finishes and new arrivals (the real scheduler drives it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.simulation.null_engine import NullEngine
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, batch_size_buckets

BLOCK_SIZE = 4
MAX_SEQS = 6


def expected_inputs(out: SchedulerOutput) -> dict[str, list]:
    """Each scheduled chunk, spelled out token by token from the sequences themselves."""
    ids, positions, slots, seq_lens, tables = [], [], [], [], []
    for item in out.scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        for pos in range(start, start + item.num_tokens):
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        seq_lens.append(start + item.num_tokens)
        tables.append(list(seq.block_ids))
    return {"input_ids": ids, "positions": positions, "slot_mapping": slots, "seq_lens": seq_lens,
            "tables": tables}


@pytest.mark.parametrize("pad_decodes", [False, True])
def test_incremental_batch_equals_a_fresh_build_every_step(pad_decodes: bool) -> None:
    engine = NullEngine(num_blocks=10, block_size=BLOCK_SIZE, max_num_seqs=MAX_SEQS, max_num_batched_tokens=10)
    batch = InputBatch(MAX_SEQS, 10, max_blocks_per_seq=16, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                       pad_decodes=pad_decodes)
    rng = np.random.default_rng(0)
    arrivals = 0
    preempted = 0
    for _ in range(200):
        if arrivals < 24 and rng.random() < 0.5:
            prompt = [int(t) for t in rng.integers(0, 50, int(rng.integers(1, 14)))]
            engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(1, 12)), n=int(rng.integers(1, 3))))
            arrivals += 1
        if not engine.scheduler.has_work():
            continue
        out = engine.scheduler.schedule()
        preempted += len(out.preempted)
        if out.scheduled:
            inputs = batch.prepare(out)
            want = expected_inputs(out)
            num_tokens, num_seqs = len(want["input_ids"]), len(want["seq_lens"])
            assert inputs.input_ids[:num_tokens].tolist() == want["input_ids"]
            assert inputs.positions[:num_tokens].tolist() == want["positions"]
            assert inputs.attn.slot_mapping[:num_tokens].tolist() == want["slot_mapping"]
            assert (inputs.attn.slot_mapping[num_tokens:] == -1).all()
            assert inputs.attn.seq_lens[:num_seqs].tolist() == want["seq_lens"]
            table = inputs.attn.block_table
            for row, blocks in enumerate(want["tables"]):
                assert table[row, : len(blocks)].tolist() == blocks
            completing = [i for i, item in enumerate(out.scheduled) if item.completes_prefill]
            ends = inputs.attn.query_start_loc[1:].tolist()
            assert inputs.logits_indices.tolist() == [ends[i] - 1 for i in completing]
            if pad_decodes and num_tokens == num_seqs:
                assert inputs.attn.seq_lens.numel() in batch_size_buckets(MAX_SEQS)
            # Only steps whose every row decodes and samples may replay a captured decode graph.
            all_decode = num_tokens == num_seqs and len(completing) == num_seqs
            assert inputs.decode_rows == (num_seqs if all_decode else None)
        engine.scheduler.update_from_output(out, [int(t) for t in rng.integers(0, 50, len(out.samples))])
    assert preempted > 0, "the pool was meant to be small enough to preempt"
    assert len(batch._row_of) <= MAX_SEQS


def test_buckets_cover_every_batch_size() -> None:
    buckets = batch_size_buckets(50)
    assert buckets[:4] == (1, 2, 4, 8) and buckets[-1] >= 50
    assert all(any(b >= n for b in buckets) for n in range(1, 51))
