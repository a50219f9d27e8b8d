"""The persistent input batch: host buffers reused every step, block tables kept row by row.

Each running sequence owns a row of one preallocated block table, written
incrementally: a step copies only the block ids a sequence gained (and
rewrites its last one, which copy-on-write may have replaced), never its whole
table. A step's token ids, positions, lengths and slots are written into
preallocated arrays; on CUDA they live in pinned memory so the copy to the
device is asynchronous. Decode batches are padded to a few bucketed sizes
(padding tokens write no KV), so a decode step has a handful of shapes that a
CUDA graph could capture.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.request import Sample
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.lora.mapping import LoRAMapping, build_lora_mapping
from pagedllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Device tensors of one step."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]: the flat index of each sampled sequence's last token
    # Set when every row decodes one token and samples it: the number of real rows before the padding.
    decode_rows: int | None = None
    lora: LoRAMapping | None = None  # the step's tokens grouped by adapter slot; None: no adapter token


def batch_size_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Padded decode batch sizes: 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``."""
    small = [size for size in (1, 2, 4) if size < max_num_seqs]
    return (*small, *range(8, max_num_seqs + 8, 8))


class InputBatch:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, pad_decodes: bool = False,
                 lora_slot_of: Callable[[int], int] | None = None) -> None:
        self.block_size = block_size
        self.lora_slot_of = lora_slot_of  # an adapter's (lora_int_id) device slot; None: LoRA is off
        self.device = device
        self.pad_decodes = pad_decodes
        self.buckets = batch_size_buckets(max_num_seqs)
        max_tokens = max(max_num_batched_tokens, self.buckets[-1])
        max_rows = self.buckets[-1]
        pin = device.type == "cuda"

        def buffer(*shape: int, dtype: torch.dtype = torch.int64) -> np.ndarray:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin).numpy()

        self._input_ids = buffer(max_tokens)
        self._positions = buffer(max_tokens)
        self._slot_mapping = buffer(max_tokens)
        # The attention metadata is int32, as the kernels read it: held so, it needs no conversion per step.
        self._query_start_loc = buffer(max_rows + 1, dtype=torch.int32)
        self._seq_lens = buffer(max_rows, dtype=torch.int32)
        self._logits_indices = buffer(max_tokens)  # speculative steps read logits at every drafted position
        self._step_table = buffer(max_rows, max_blocks_per_seq, dtype=torch.int32)
        # One row per running sequence; rows are recycled when sequences finish or are preempted.
        self._tables = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        # Each row's block count and last written block id, as Python ints: most steps a decode's
        # table is unchanged, and comparing ints skips numpy reads and writes per sequence.
        self._num_known: list[int] = [0] * max_rows
        self._last_block: list[int | None] = [None] * max_rows
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        for seq in step.preempted:
            self._release(seq.seq_id)
        for seq_id in step.finished_seq_ids:
            self._release(seq_id)
        scheduled = step.scheduled
        num_seqs = len(scheduled)
        query_lens = np.fromiter((item.num_tokens for item in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((item.seq.num_computed_tokens for item in scheduled), dtype=np.int64, count=num_seqs)
        row_ids = [self._sync_row(item.seq) for item in scheduled]
        rows = np.array(row_ids, dtype=np.int64)
        num_tokens = int(query_lens.sum())
        is_decode = num_tokens == num_seqs
        padded_seqs = self._bucket(num_seqs) if is_decode and self.pad_decodes else num_seqs
        padded_tokens = padded_seqs if is_decode else num_tokens

        query_start_loc = self._query_start_loc[: padded_seqs + 1]
        query_start_loc[0] = 0
        np.cumsum(query_lens, out=query_start_loc[1 : num_seqs + 1])
        query_start_loc[num_seqs + 1 :] = np.arange(num_tokens + 1, padded_tokens + 1)
        seq_lens = self._seq_lens[:padded_seqs]
        np.add(starts, query_lens, out=seq_lens[:num_seqs])
        seq_lens[num_seqs:] = 1

        input_ids = self._input_ids[:padded_tokens]
        if is_decode:
            input_ids[:num_seqs] = [item.seq.token_ids[-1] for item in scheduled]
        else:
            chunks: list[int] = []
            for item in scheduled:  # list slices, not a Python loop over every prompt token
                start = item.seq.num_computed_tokens
                chunks += item.seq.token_ids[start : start + item.num_tokens]
                if item.spec_token_ids:
                    chunks += item.spec_token_ids
            input_ids[:num_tokens] = chunks
        input_ids[num_tokens:] = 0

        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = self._positions[:padded_tokens]
        np.add(np.arange(num_tokens) - query_start_loc[seq_of_token], starts[seq_of_token], out=positions[:num_tokens])
        positions[num_tokens:] = 0

        width = max(map(self._num_known.__getitem__, row_ids))
        table = self._step_table[:padded_seqs, :width]
        table[:num_seqs] = self._tables[rows, :width]
        table[num_seqs:] = 0
        slot_mapping = self._slot_mapping[:padded_tokens]
        bs = self.block_size
        np.add(table[seq_of_token, positions[:num_tokens] // bs] * np.int64(bs), positions[:num_tokens] % bs,
               out=slot_mapping[:num_tokens])
        slot_mapping[num_tokens:] = -1  # padding writes no KV

        completing = step.completing
        logits_indices = self._logits_indices[: len(completing) + step.num_drafted]
        ends = query_start_loc[1 : num_seqs + 1]
        if step.num_drafted:  # a verifying sequence needs the logits of its last 1 + k positions
            widths = np.fromiter((1 + len(scheduled[i].spec_token_ids) for i in completing), dtype=np.int64,
                                 count=len(completing))
            firsts = np.repeat(ends[list(completing)] - widths, widths)
            np.add(firsts, np.arange(len(logits_indices)) - np.repeat(np.cumsum(widths) - widths, widths),
                   out=logits_indices)
        elif len(completing) == num_seqs:  # every row samples: the usual decode step
            np.subtract(ends, 1, out=logits_indices)
        else:
            logits_indices[:] = ends[list(completing)] - 1

        put = self._to_device
        attn = AttentionMetadata(
            query_start_loc=put(query_start_loc, torch.int32),
            seq_lens=put(seq_lens, torch.int32),
            block_table=put(table, torch.int32),
            slot_mapping=put(slot_mapping, torch.int64),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        decode_rows = num_seqs if is_decode and len(completing) == num_seqs else None
        lora = None
        if self.lora_slot_of is not None:
            slot_of = self.lora_slot_of
            seq_slots = np.fromiter((slot_of(item.seq.request.lora_int_id) for item in scheduled), dtype=np.int64,
                                    count=num_seqs)
            lora = build_lora_mapping(seq_slots, query_lens, self.device)
        return StepInputs(put(input_ids, torch.int64), put(positions, torch.int64), attn,
                          put(logits_indices, torch.int64), decode_rows, lora)

    def _sync_row(self, seq: Sample) -> int:
        """The sequence's table row, with any block ids it gained since the last step written in."""
        block_ids = seq.block_ids
        row = self._row_of.get(seq.seq_id)
        if row is None:
            row = self._free_rows.pop()
            self._row_of[seq.seq_id] = row
            self._num_known[row] = 0
            self._last_block[row] = None
        num_blocks = len(block_ids)
        known = self._num_known[row]
        last = block_ids[-1] if block_ids else None
        if num_blocks == known and last == self._last_block[row]:
            return row
        # The last known block may have been replaced by a copy-on-write: rewrite it too.
        start = max(known - 1, 0)
        if start < num_blocks:
            self._tables[row, start:num_blocks] = block_ids[start:]
        self._num_known[row] = num_blocks
        self._last_block[row] = last
        return row

    def _release(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _bucket(self, num_seqs: int) -> int:
        return next(size for size in self.buckets if size >= num_seqs)

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            # The buffers are overwritten next step; the forward has finished with them by then.
            return tensor if tensor.dtype == dtype else tensor.to(dtype)
        return tensor.to(device=self.device, dtype=dtype, non_blocking=True)
