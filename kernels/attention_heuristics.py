"""Named heuristics that pick the attention kernel's tile sizes and its split-KV plan.

Pure Python on host-known shapes only: nothing here reads a device tensor, so
choosing a plan never forces a GPU synchronisation. The longest context is
bounded by ``block_table`` width times block size rather than read from
``seq_lens``.
"""
from __future__ import annotations

from dataclasses import dataclass

# tl.dot needs every dimension of its operands to be at least 16 on NVIDIA GPUs.
MIN_DOT_DIM = 16
# Query rows (query positions x packed heads) per program for decode-only and mixed batches.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
# Keys per inner-loop tile; halved for the widest heads and for fp32 (whose exact
# dot products run without tensor cores) to keep the tiles in registers.
KEY_TILE = 64
SMALL_KEY_TILE = 32
WIDE_HEAD = 256
FP32_PREFILL_BLOCK_M = 32
# Split-KV: aim for this many programs per streaming multiprocessor, but give every
# split at least this many keys so the reduce step stays cheap next to the split work.
PROGRAMS_PER_SM = 2
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """Compile-time tile shape of one attention launch."""

    head_pad: int  # head_dim rounded up to a power of two; padded lanes are masked
    group: int  # query heads per KV head
    group_pad: int  # group rounded up to a power of two; padded heads are masked
    block_q: int  # query positions per program
    block_m: int  # query rows per program: block_q * group_pad
    tile_n: int  # keys per inner-loop tile
    num_splits: int  # 1 = single pass; > 1 = split-KV partials plus a reduce launch
    num_warps: int


def next_power_of_two(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """Head sizes like 80 or 96 run in the next power-of-two tile, masked."""
    return max(next_power_of_two(head_dim), MIN_DOT_DIM)


def query_rows_per_program(is_decode_only: bool, group_pad: int, element_size: int) -> int:
    """Decode programs hold one query position per packed head; prefill holds many positions."""
    if is_decode_only:
        target = DECODE_BLOCK_M
    else:
        target = FP32_PREFILL_BLOCK_M if element_size >= 4 else PREFILL_BLOCK_M
    return max(target, group_pad, MIN_DOT_DIM)


def key_tile(head_pad: int, element_size: int) -> int:
    return SMALL_KEY_TILE if head_pad >= WIDE_HEAD or element_size >= 4 else KEY_TILE


def num_kv_splits(
    num_seqs: int,
    num_tokens: int,
    num_kv_heads: int,
    max_context: int,
    num_sms: int,
) -> int:
    """How many slices to cut each sequence's keys into (flash-decoding).

    Only decode-only batches split: there, one program per (sequence, KV head)
    can leave most of the GPU idle when sequences are few and contexts long.
    Returns a power of two; 1 means the single-pass kernel.
    """
    if num_tokens != num_seqs or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
    affordable = max_context // MIN_KEYS_PER_SPLIT
    splits = min(wanted, affordable, MAX_SPLITS)
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)


def plan_attention(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    num_sms: int,
    element_size: int = 2,
    num_splits: int | None = None,
) -> AttentionTiles:
    """Tile sizes for one launch (``element_size``: bytes per q/K/V element);
    ``num_splits=None`` lets :func:`num_kv_splits` decide."""
    group = num_heads // num_kv_heads
    group_pad = next_power_of_two(group)
    head_pad = padded_head_dim(head_dim)
    block_m = query_rows_per_program(num_tokens == num_seqs, group_pad, element_size)
    if num_splits is None:
        num_splits = num_kv_splits(num_seqs, num_tokens, num_kv_heads, max_context, num_sms)
    return AttentionTiles(
        head_pad=head_pad,
        group=group,
        group_pad=group_pad,
        block_q=block_m // group_pad,
        block_m=block_m,
        tile_n=key_tile(head_pad, element_size),
        num_splits=num_splits,
        num_warps=4 if block_m * head_pad <= 64 * 128 else 8,
    )
