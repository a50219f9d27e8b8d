"""Named heuristics that pick the attention kernel's tiles and its split-KV plan.

Pure Python on host-known shapes only: nothing here reads a device tensor, so
choosing a plan never forces a GPU synchronisation. The longest context is
bounded by ``block_table`` width times block size rather than read from
``seq_lens``. Tile, warp and stage settings come from the per-family table in
:mod:`pagedllm.kernels.attention_tiles`; this module adapts them to the shape
(GQA widening, padding) and decides the split count.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kernels.attention_tiles import tile_config, tile_family

# tl.dot needs every dimension of its operands to be at least 16 on NVIDIA GPUs.
MIN_DOT_DIM = 16
# Split-KV: one program per SM is enough to fill the GPU (each program keeps its
# key loop's stages in flight); every split gets at least this many keys so the
# reduce launch stays cheap next to the split work; the reduce kernel holds all
# splits of one head in registers, which bounds their number.
PROGRAMS_PER_SM = 1
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
    num_stages: int = 1  # software-pipelining depth of the key loop


def next_power_of_two(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """Head sizes like 80 or 96 run in the next power-of-two tile, masked."""
    return max(next_power_of_two(head_dim), MIN_DOT_DIM)


def num_kv_splits(
    num_seqs: int,
    num_tokens: int,
    num_kv_heads: int,
    max_context: int,
    num_sms: int,
    tile_n: int = 64,
) -> int:
    """How many slices to cut each sequence's keys into (flash-decoding): enough programs to fill the GPU, no more.

    A decode program serves one (sequence, KV head) with all of that KV head's
    query heads packed into its tile, so a decode-only batch launches
    ``num_seqs * num_kv_heads`` programs per split. Splitting adds programs
    until there is one per SM (the smallest such count), but never cuts a slice
    below ``MIN_KEYS_PER_SPLIT`` keys, never makes more slices than key tiles,
    and never exceeds ``MAX_SPLITS``. The result never falls as the context
    grows, never rises as the batch grows, and is 1 once the batch alone fills
    the GPU. Batches with prefill chunks have query blocks enough: 1.
    """
    if num_tokens != num_seqs or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
    key_tiles = -(-max_context // tile_n)
    affordable = key_tiles // -(-MIN_KEYS_PER_SPLIT // tile_n)
    return max(1, min(wanted, affordable, MAX_SPLITS))


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
    """Tile sizes for one launch (``element_size``: bytes per q element);
    ``num_splits=None`` lets :func:`num_kv_splits` decide."""
    group = num_heads // num_kv_heads
    group_pad = next_power_of_two(group)
    head_pad = padded_head_dim(head_dim)
    is_decode_only = num_tokens == num_seqs
    config = tile_config(tile_family(is_decode_only, head_pad, element_size))
    # GQA packing: every query head of a KV head shares the program, so the tile widens to hold them all.
    block_m = max(config.block_m, group_pad, MIN_DOT_DIM)
    if num_splits is None:
        num_splits = num_kv_splits(num_seqs, num_tokens, num_kv_heads, max_context, num_sms, config.tile_n)
    return AttentionTiles(
        head_pad=head_pad,
        group=group,
        group_pad=group_pad,
        block_q=block_m // group_pad,
        block_m=block_m,
        tile_n=config.tile_n,
        num_splits=num_splits,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
