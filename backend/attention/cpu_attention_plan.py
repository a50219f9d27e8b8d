"""The CPU attention's per-step plan: index math and masks, in numpy, once per step.

:func:`plan_cpu_attention` keeps the step's lengths and block table on the host;
the first layer derives a :class:`StepLayout` from them (it needs the cache's
block size and dtype) and every later layer reuses it:

* decodes (one query token) of similar context length share a padded batch in
  which the query heads of one KV head form the "query" axis, so K/V are never
  repeated per query head and the batch is a single fused SDPA;
* decodes whose block tables start with the same blocks form a
  :class:`SharedPrefix`, attended once for all of them (cascade attention);
* or, when the compiled routine runs the decodes (:class:`NativeDecodes`), every
  decode attends its whole table in place, shared prefix included;
* each prefill chunk attends alone over its own context, causally: in torch SDPA
  over its gathered blocks, or, where :func:`native_prefill_wins` says the compiled
  routine is faster (:class:`NativePrefills`), in place.

Every group's blocks are listed in one ``block_ids`` tensor, so a layer gathers
K and V with one ``index_select`` each.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata

# Decodes join a padded batch while their block count is at least this share of the
# batch's longest; below it, a new batch is cheaper than attending to the padding
# (long-tail contexts, measured: RESULTS.md, "Figures behind the code's choices").
DECODE_BATCH_FILL = 0.7
# Decodes whose block tables start with the same blocks (prefix caching, forks) attend to that shared
# prefix together once it is at least this long; below it, the extra call costs more than it saves.
MIN_SHARED_PREFIX_BLOCKS = 4
# Prefill chunks attending to at most this many (query, key) pairs run in the compiled routine, when it is
# built; bigger ones in SDPA (measurements: native_prefill_wins).
NATIVE_PREFILL_MAX_PAIRS = 96 * 1024
# Chunks of at most this many new tokens after earlier context run in the compiled decode routine, a decode per
# token: a speculative verification's k + 1 positions (vLLM's default k is at most 5), not a prompt's prefill.
MAX_CHUNK_AS_DECODES = 8


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Decoding sequences padded to one width: one SDPA over ``[num_seqs, kv_heads, group, head_dim]``."""

    tokens: torch.Tensor  # int64 [num_seqs]: each sequence's query token
    first_block: int  # its first row in the step's gathered blocks
    num_seqs: int
    blocks_per_seq: int
    mask: torch.Tensor | None  # additive [num_seqs, 1, 1, keys]; None when every key is real


@dataclass(frozen=True, slots=True)
class NativeDecodes:
    """Every decode of the step, for the compiled routine (:mod:`pagedllm.attention.native_decode`), which reads
    their blocks where they lie: they are neither gathered nor padded."""

    rows: np.ndarray  # int64 [num_seqs]: each sequence's query token
    block_table: np.ndarray  # int64 [num_seqs, width], C-contiguous
    lens: np.ndarray  # int64 [num_seqs]: context lengths
    max_len: int
    # The table's smallest and largest block ids: the routine checks them against the cache it reads,
    # once per layer, without scanning the table again.
    lowest_block: int
    highest_block: int
    # Addresses of rows, block_table and lens, which this record keeps alive: read once per step,
    # because numpy's ``.ctypes.data`` costs microseconds and every layer passes them.
    addresses: tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class NativePrefills:
    """Prefill chunks for the compiled routine (:mod:`pagedllm.attention.native_prefill`), which reads their
    blocks where they lie: they are neither gathered nor masked."""

    starts: np.ndarray  # int64 [num_seqs]: each chunk's first flat token
    query_lens: np.ndarray  # int64 [num_seqs]
    seq_lens: np.ndarray  # int64 [num_seqs]: the chunk is the last query_len of them
    block_table: np.ndarray  # int64 [num_seqs, width], C-contiguous
    lowest_block: int  # checked against the cache once per layer, as NativeDecodes' are
    highest_block: int
    addresses: tuple[int, int, int, int]  # of starts, query_lens, seq_lens and block_table, kept alive here


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Decodes that start with the same blocks: their queries attend to those blocks as one block of rows.

    The blocks are gathered once instead of once per sequence, and the attention is a
    matrix product instead of one matrix-vector product per sequence (cascade attention).
    Each sequence's own blocks after the prefix go through its :class:`DecodeBatch`; the
    two partial results merge by their log-sum-exps.
    """

    tokens: torch.Tensor  # int64 [num_seqs]: each sharing sequence's query token
    first_block: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence's several new tokens: causal SDPA over its own context."""

    start: int  # first flat token
    query_len: int
    seq_len: int  # keys it attends to: the gathered blocks' first seq_len slots
    first_block: int
    num_blocks: int
    # Additive [query_len, seq_len] for a chunk after earlier context; None for a first chunk, which
    # runs SDPA's own is_causal, faster than a mask (measured: RESULTS.md, "Figures behind the code's choices").
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Everything a layer needs, for one block size and dtype."""

    block_ids: torch.Tensor  # int64 [rows]: every group's blocks, gathered in one index_select
    decodes: tuple[DecodeBatch, ...]
    native_decodes: NativeDecodes | None  # the decodes instead, when the compiled routine runs them
    native_prefills: NativePrefills | None  # chunks the compiled prefill routine runs (not in ``prefills``)
    shared_prefixes: tuple[SharedPrefix, ...]
    prefills: tuple[PrefillChunk, ...]
    # All decodes, in one batch, in the batch's own order, none with a shared prefix: the
    # queries need no reordering and the batch's result is the answer.
    decodes_in_order: bool


@dataclass(frozen=True, slots=True)
class CpuAttentionPlan:
    """The step's lengths and block table on the host; layouts derived once per (block size, dtype, native,
    native_prefill).

    The block size and dtype belong to the cache, which the metadata does not
    describe, so the first layer derives the layout and every later layer reuses it.
    ``native`` says whether the compiled decode routine runs the decodes, ``native_prefill``
    whether the compiled prefill routine may run the prefill chunks (those it is faster for).
    """

    starts: np.ndarray  # int64 [num_seqs + 1]
    seq_lens: np.ndarray  # int64 [num_seqs]
    block_table: np.ndarray  # int64 [num_seqs, width]
    device: torch.device
    layouts: dict[tuple[int, torch.dtype, bool, bool, bool], StepLayout] = field(default_factory=dict)

    def layout(self, block_size: int, dtype: torch.dtype, native: bool, native_prefill: bool = False,
               wide_prefill: bool = False) -> StepLayout:
        """``wide_prefill``: the compiled prefill routine was built with 16-lane vectors (see
        :func:`native_prefill_wins`)."""
        key = (block_size, dtype, native, native_prefill, wide_prefill)
        if key not in self.layouts:
            self.layouts[key] = _layout(self, block_size, dtype, native, native_prefill, wide_prefill)
        return self.layouts[key]


def plan_cpu_attention(metadata: AttentionMetadata) -> AttentionMetadata:
    """The metadata with a :class:`CpuAttentionPlan` attached; call once per step."""
    plan = CpuAttentionPlan(
        starts=metadata.query_start_loc.cpu().numpy().astype(np.int64),
        seq_lens=metadata.seq_lens.cpu().numpy().astype(np.int64),
        block_table=metadata.block_table.cpu().numpy().astype(np.int64),
        device=metadata.block_table.device,
    )
    return replace(metadata, plan=plan)


def _layout(plan: CpuAttentionPlan, block_size: int, dtype: torch.dtype, native: bool,
            native_prefill: bool, wide_prefill: bool) -> StepLayout:
    """Index math in numpy, one host-to-torch conversion per tensor: this runs once per step."""
    query_lens = np.diff(plan.starts)
    decoding = np.flatnonzero(query_lens == 1)
    # The usual steps (decodes, verifications) have the compiled routine read every sequence in place, so nothing
    # after these returns applies to them. Returning early keeps this per-step host work to a few numpy calls,
    # which a small model's forward (a speculative draft's) pays once per forward.
    if native and len(decoding) == len(query_lens) and len(decoding):
        return _in_place_layout(plan, decoding, decoding[:0], block_size)
    # A few new tokens after earlier context (a speculative verification, a short chunk) run as one decode per
    # token, each over the context up to itself: the compiled routine takes them with the step's decodes, so a
    # verification step is computed as the same positions' plain decodes are.
    short = (query_lens > 1) & (query_lens <= MAX_CHUNK_AS_DECODES) & (plan.seq_lens > query_lens)
    as_decodes = np.flatnonzero(short) if native else np.zeros(0, dtype=np.int64)
    if native and len(decoding) + len(as_decodes) == len(query_lens) and len(query_lens):
        return _in_place_layout(plan, decoding, as_decodes, block_size)
    num_blocks = -(-plan.seq_lens // block_size)
    block_ids: list[np.ndarray] = []
    rows = 0

    skipped = np.zeros_like(num_blocks)  # leading blocks a decode attends to through its shared prefix
    shared_prefixes = []
    # The compiled routine reads a shared prefix in place, from cache for every sharer after the
    # first, so cascade's extra SDPA and merge cost more than they save (tiny shared-prefix, measured:
    # RESULTS.md, "Figures behind the code's choices").
    for seqs, shared in [] if native else _shared_prefixes(decoding, plan.block_table, plan.seq_lens, block_size):
        block_ids.append(plan.block_table[seqs[0], :shared])
        shared_prefixes.append(SharedPrefix(_tensor(plan.starts[seqs], plan.device), rows, shared))
        skipped[seqs] = shared
        rows += shared

    decodes = []
    native_decodes = (_native_decodes(plan, decoding, as_decodes, block_size)
                      if native and len(decoding) + len(as_decodes) else None)
    own_blocks = num_blocks - skipped
    for seqs in [] if native else _decode_batches(decoding, own_blocks):
        width = int(own_blocks[seqs].max())
        # Columns past a row's own blocks hold whatever the table has there; the mask hides them.
        columns = np.minimum(skipped[seqs, None] + np.arange(width)[None, :], plan.block_table.shape[1] - 1)
        block_ids.append(np.take_along_axis(plan.block_table[seqs], columns, axis=1).reshape(-1))
        lens = plan.seq_lens[seqs] - skipped[seqs] * block_size
        visible = np.arange(width * block_size)[None, :] < lens[:, None]
        decodes.append(DecodeBatch(
            tokens=_tensor(plan.starts[seqs], plan.device),
            first_block=rows,
            num_seqs=len(seqs),
            blocks_per_seq=width,
            mask=None if visible.all() else _additive(visible[:, None, None], dtype, plan.device),
        ))
        rows += len(seqs) * width

    chunks = np.flatnonzero((query_lens > 1) & ~short) if native else np.flatnonzero(query_lens > 1)
    in_place = np.array([native_prefill_wins(int(query_lens[seq]), int(plan.seq_lens[seq]), wide_prefill)
                         for seq in chunks]
                        if native_prefill else [False] * len(chunks), dtype=bool)
    in_place_chunks = native_prefills(plan, chunks[in_place], block_size) if in_place.any() else None
    prefills = []
    for seq in chunks[~in_place]:
        width, query_len, seq_len = int(num_blocks[seq]), int(query_lens[seq]), int(plan.seq_lens[seq])
        block_ids.append(plan.block_table[seq, :width])
        visible = np.arange(seq_len)[None, :] <= np.arange(seq_len - query_len, seq_len)[:, None]
        mask = None if query_len == seq_len else _additive(visible, dtype, plan.device)
        prefills.append(PrefillChunk(int(plan.starts[seq]), query_len, seq_len, rows, width, mask))
        rows += width

    ids = np.concatenate(block_ids) if block_ids else np.zeros(0, dtype=np.int64)
    # Every sequence decodes, in one batch: _decode_batches kept them in the batch's order.
    in_order = len(decodes) == 1 and decodes[0].num_seqs == len(query_lens) and not shared_prefixes
    return StepLayout(_tensor(ids, plan.device), tuple(decodes), native_decodes, in_place_chunks,
                      tuple(shared_prefixes), tuple(prefills), in_order)


def _in_place_layout(plan: CpuAttentionPlan, decoding: np.ndarray, as_decodes: np.ndarray,
                     block_size: int) -> StepLayout:
    """A step whose every sequence the compiled decode routine runs: nothing to gather."""
    return StepLayout(torch.empty(0, dtype=torch.int64, device=plan.device), (),
                      _native_decodes(plan, decoding, as_decodes, block_size), None, (), (), False)


def _native_decodes(plan: CpuAttentionPlan, seqs: np.ndarray, chunks: np.ndarray, block_size: int) -> NativeDecodes:
    """The decodes ``seqs``, and each token of the short ``chunks`` as a decode of its own, for the compiled routine;
    ``ValueError`` for a context longer than its table row, which C would read past (the torch path clamps
    instead)."""
    every = len(seqs) == len(plan.seq_lens)  # the usual step: the plan's arrays serve as they are
    rows = plan.starts[:-1] if every else plan.starts[seqs]
    table = plan.block_table if every else plan.block_table[seqs]
    lens = plan.seq_lens if every else plan.seq_lens[seqs]
    if len(chunks):
        query_lens = plan.starts[chunks + 1] - plan.starts[chunks]
        owner = np.repeat(chunks, query_lens)
        # Token j of a chunk of q new tokens over s keys sees the first s - q + j + 1 of them.
        offset = np.arange(len(owner)) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
        rows = np.concatenate([rows, plan.starts[owner] + offset])
        table = np.concatenate([table, plan.block_table[owner]])
        lens = np.concatenate([lens, plan.seq_lens[owner] - np.repeat(query_lens, query_lens) + offset + 1])
    order = _by_first_block(table)
    rows, table, lens = rows[order], table[order], lens[order]
    max_len = int(lens.max())
    if -(-max_len // block_size) > table.shape[1]:
        raise ValueError(f"a context of {max_len} tokens runs past the end of its block-table row "
                         f"({table.shape[1]} blocks of {block_size})")
    return NativeDecodes(rows, table, lens, max_len, int(table.min()), int(table.max()),
                         (rows.ctypes.data, table.ctypes.data, lens.ctypes.data))


def native_prefill_wins(query_len: int, seq_len: int, wide: bool = False) -> bool:
    """Whether the compiled routine beats gather + SDPA for a chunk of ``query_len`` tokens ending at ``seq_len``;
    ``wide``: the routine was built with 16-lane vectors (AVX-512).

    Wide, it won on every chunk measured on an AVX-512 Xeon, so a wide build takes every
    chunk. The 8-lane build (AVX2 only) draws a line, measured on an AMD EPYC
    with the routine's earlier layout (the 8-lane build of today's ran level with it on the Xeon
    with AVX-512 turned off). Both do work in proportion to the (query, key) pairs the chunk attends to,
    ``query_len * (seq_len - query_len / 2)``; the compiled routine saves the gather, the
    mask and SDPA's fixed cost, which dominate small chunks, and SDPA's BLAS-backed
    blocks run the products faster, which wins for big ones. The 8-lane routine wins below
    the pair count where the two run level and loses above it, so the rule draws the line
    there, at :data:`NATIVE_PREFILL_MAX_PAIRS`. Measured with ``pagedllm bench kernels``
    (:mod:`pagedllm_bench.cpu_prefill`): RESULTS.md, "Figures behind the code's choices",
    "Rows as columns in the paged prefill" and "Paged prefill attention on CPU".
    """
    return wide or query_len * (seq_len - query_len / 2) <= NATIVE_PREFILL_MAX_PAIRS


def native_prefills(plan: CpuAttentionPlan, seqs: np.ndarray, block_size: int) -> NativePrefills:
    """The chunks ``seqs`` (sequence indices) for the compiled routine, whatever :func:`native_prefill_wins`
    says (the benchmark times both sides); ``ValueError`` for a context longer than its table row."""
    seqs = seqs[_by_first_block(plan.block_table[seqs])]
    table = np.ascontiguousarray(plan.block_table[seqs])
    starts = np.ascontiguousarray(plan.starts[seqs])
    query_lens = np.ascontiguousarray(plan.starts[seqs + 1] - plan.starts[seqs])
    lens = np.ascontiguousarray(plan.seq_lens[seqs])
    if -(-int(lens.max()) // block_size) > table.shape[1]:
        raise ValueError(f"a context of {int(lens.max())} tokens runs past the end of its block-table row "
                         f"({table.shape[1]} blocks of {block_size})")
    return NativePrefills(starts, query_lens, lens, table, int(table.min()), int(table.max()),
                          (starts.ctypes.data, query_lens.ctypes.data, lens.ctypes.data, table.ctypes.data))


def _by_first_block(table: np.ndarray) -> np.ndarray:
    """The order in which the compiled routines take the rows of ``table``: those behind the same cached prefix
    one after another.

    Both routines attend (sequence, KV head) items in the order they are given, so a prefix's blocks, read by
    its first sharer, are still in the core's cache for the next. In arrival order, the sharers of several
    prefixes take turns and evict each other's blocks. Each sequence's result goes to its own query rows, so
    the order changes no value (measured: RESULTS.md, "Decodes and prefill chunks grouped by prefix").
    """
    return np.argsort(table[:, 0], kind="stable")


def _shared_prefixes(seqs: np.ndarray, block_table: np.ndarray, seq_lens: np.ndarray,
                     block_size: int) -> list[tuple[np.ndarray, int]]:
    """Groups of decodes whose tables start with the same blocks, and how many blocks they share.

    A shared block holds the same tokens for every sequence that has it (prefix caching
    shares only full blocks; a fork's shared last block is copied before it is written),
    but only blocks before every member's newest token are used, so that all members see
    all of the prefix.
    """
    by_first_block: dict[int, list[int]] = {}
    for seq in seqs:
        by_first_block.setdefault(int(block_table[seq, 0]), []).append(int(seq))
    groups = []
    for members in by_first_block.values():
        if len(members) < 2:
            continue
        table = block_table[members]
        same = (table == table[0]).all(axis=0)
        shared = len(same) if same.all() else int(np.argmin(same))
        shared = min(shared, (int(seq_lens[members].min()) - 1) // block_size)
        if shared >= MIN_SHARED_PREFIX_BLOCKS:
            groups.append((np.array(members), shared))
    return groups


def _decode_batches(seqs: np.ndarray, num_blocks: np.ndarray) -> list[np.ndarray]:
    """Split decoding sequences into batches of similar block counts (all in one when they are alike)."""
    if len(seqs) == 0:
        return []
    order = seqs[np.argsort(-num_blocks[seqs], kind="stable")]
    descending = -num_blocks[order]
    batches = []
    first = 0
    while first < len(order):
        floor = num_blocks[order[first]] * DECODE_BATCH_FILL
        end = int(np.searchsorted(descending, -floor, side="right"))
        batches.append(order[first:end])
        first = end
    # One batch: keep the caller's order, so that queries need no reordering.
    return [seqs] if len(batches) == 1 else batches


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _additive(visible: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where visible, -inf elsewhere, in the queries' dtype (what SDPA adds to the scores)."""
    mask = np.where(visible, np.float32(0.0), np.float32(-np.inf))
    return torch.from_numpy(mask).to(device=device, dtype=dtype)
