"""A step's inputs as one int64 buffer that rank 0 broadcasts to the other ranks, once per step.

Rank 0 prepares the step (``InputBatch``) and sends the result, so the other
ranks keep no scheduler state: they unpack, run the same forward and join its
collectives. One message (``TensorParallel.broadcast_ints``: through the ranks'
shared memory on one CPU host) holds a fixed 16-int header of sizes, then the
payload: token ids, positions, slots, ``query_start_loc``, ``seq_lens``, the
block table, the sampled rows and the step's copy-on-write block pairs. Block ids are the same on every rank, so the
table is sent as rank 0 holds it. With LoRA, each sequence's adapter slot follows
(the ranks rebuild the step's grouping from it), and on the steps that fill slots,
one object broadcast says which adapter went into which slot.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed.group import TensorParallel
from pagedllm.lora.mapping import build_lora_mapping
from pagedllm.lora.request import LoRARequest
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.input_batch import StepInputs

HEADER_SIZE = 16
LoRALoads = list[tuple[int, LoRARequest]]  # (slot, adapter) filled on rank 0 before a step
_STOP, _STEP = 0, 1


def broadcast_step(inputs: StepInputs, block_copies: list[tuple[int, int]], tp: TensorParallel,
                   lora_loads: LoRALoads | None = None) -> None:
    """Rank 0: send one step to every other rank (``lora_loads``: the adapters it put into slots before it)."""
    device = tp.device
    attn = inputs.attn
    num_tokens, num_seqs = inputs.input_ids.numel(), attn.seq_lens.numel()
    width = attn.block_table.shape[1]
    copies = torch.tensor(block_copies, dtype=torch.int64, device=device).reshape(-1)
    decode_rows = -1 if inputs.decode_rows is None else inputs.decode_rows
    header = [_STEP, num_tokens, num_seqs, width, inputs.logits_indices.numel(), len(block_copies),
              attn.max_query_len, attn.max_seq_len, decode_rows, int(inputs.lora is not None), len(lora_loads or ())]
    parts = [torch.tensor(header + [0] * (HEADER_SIZE - len(header)), dtype=torch.int64), inputs.input_ids,
             inputs.positions, attn.slot_mapping, attn.query_start_loc, attn.seq_lens, attn.block_table,
             inputs.logits_indices, copies]
    if inputs.lora is not None:
        parts.append(torch.from_numpy(inputs.lora.seq_slots))
    tp.broadcast_ints(torch.cat([part.reshape(-1).to(device=device, dtype=torch.int64) for part in parts]))
    if lora_loads:
        dist.broadcast_object_list([lora_loads], src=0)


def broadcast_stop(tp: TensorParallel) -> None:
    """Rank 0: tell every other rank to leave its step loop."""
    tp.broadcast_ints(torch.zeros(HEADER_SIZE, dtype=torch.int64, device=tp.device))


def receive_step(tp: TensorParallel) -> tuple[StepInputs, list[tuple[int, int]], LoRALoads] | None:
    """Another rank: the next step's inputs, block copies and LoRA slot loads, or ``None`` when rank 0 says stop
    (waiting for it as long as the engine stays idle)."""
    device = tp.device
    message = tp.broadcast_ints(None, patient=True)
    header, payload = message[:HEADER_SIZE], message[HEADER_SIZE:]
    (command, num_tokens, num_seqs, width, num_sampled, num_copies, max_query, max_seq, decode_rows, has_lora,
     num_loads) = header[:11].tolist()
    if command == _STOP:
        return None
    lora_loads: list[LoRALoads] = [[]]
    if num_loads:
        dist.broadcast_object_list(lora_loads, src=0)
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, num_sampled,
             2 * num_copies, num_seqs if has_lora else 0]
    if payload.numel() != sum(sizes):
        raise RuntimeError(f"rank {tp.rank} received a step of {payload.numel()} ints; its header says {sum(sizes)}")
    ids, positions, slots, starts, seq_lens, table, sampled, copies, seq_slots = payload.split(sizes)
    attn = AttentionMetadata(
        query_start_loc=starts.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_table=table.reshape(num_seqs, width).to(torch.int32),
        slot_mapping=slots,
        max_query_len=max_query,
        max_seq_len=max_seq,
    )
    lora = None
    if has_lora:
        query_lens = (starts[1:] - starts[:-1]).cpu().numpy()
        lora = build_lora_mapping(seq_slots.cpu().numpy(), query_lens, device)
    inputs = StepInputs(ids, positions, attn, sampled, None if decode_rows < 0 else decode_rows, lora)
    pairs = copies.reshape(-1, 2).tolist()
    return inputs, [(src, dst) for src, dst in pairs], lora_loads[0]
