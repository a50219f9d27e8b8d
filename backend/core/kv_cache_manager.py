"""Paged KV-cache bookkeeping: block pool, block tables, copy-on-write, prefix caching.

Only block ids live here; the K/V tensors belong to the model runner. A block
is *referenced* while some sequence's block table holds it and *free*
otherwise. Free blocks keep their content hash and wait in an LRU queue, so a
later request with the same prefix can revive them; a free block is only
forgotten when it is handed out again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.core.block_hash import BlockKey, block_key
from pagedllm.core.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedllm.core.request import Sample


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and its tokens computed. ``tokens`` and ``parent`` (the
    # previous block's id and epoch) let a hit be verified, not just trusted to the key.
    block_hash: BlockKey | None = None
    tokens: tuple[int, ...] = ()
    parent: tuple[int, int] | None = None
    epoch: int = 0  # bumped whenever the block's cached content is forgotten


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached blocks that already hold the KV of a sequence's leading tokens."""

    blocks: tuple[Block, ...]
    hashes: tuple[BlockKey, ...]


NO_MATCH = PrefixMatch((), ())


class KVCacheManager:
    """``enable_kv_cache_events``: record vLLM's KV cache events (``pagedllm.core.kv_events``) as the cache
    changes, for the engine to take after each step (``take_events``)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 enable_kv_cache_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict: O(1) pop of the least recently freed block and O(1) removal of a revived one.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockKey, Block] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # Blocks published for KV that the step being run is still computing (``cache_full_blocks`` ahead).
        self._uncomputed: list[Block] = []
        self.peak_blocks_used = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self._events: list[KVCacheEvent] | None = [] if enable_kv_cache_events and enable_prefix_caching else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sample) -> PrefixMatch:
        """Longest run of cached full blocks equal to ``seq``'s leading tokens.

        The last token is never matched: its logits must be computed to sample.
        A candidate is used only if it holds exactly these tokens after exactly
        the blocks already matched, so a key collision costs a miss, never KV
        computed for other tokens.
        """
        # A request for prompt logprobs computes every prompt position (vLLM skips the cache for them too).
        if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return NO_MATCH
        blocks: list[Block] = []
        hashes: list[BlockKey] = []
        key: BlockKey | None = None
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            key = block_key(key, tokens, seq.request.lora_int_id)
            block = self._cached.get(key)
            parent = (blocks[-1].block_id, blocks[-1].epoch) if blocks else None
            if block is None or block.tokens != tokens or block.parent != parent:
                break
            blocks.append(block)
            hashes.append(key)
        return PrefixMatch(tuple(blocks), tuple(hashes))

    def allocate(self, seq: Sample, num_new_tokens: int, match: PrefixMatch = NO_MATCH) -> bool:
        """Give ``seq`` the blocks to hold ``num_new_tokens`` more computed tokens.

        Adopts ``match`` (a fresh sequence's cached prefix) first. All or nothing:
        returns False, changing nothing, when the free pool is too small.
        """
        held = seq.block_ids
        if not match.blocks and seq.num_computed_tokens + num_new_tokens <= len(held) * self.block_size:
            # The decode fast path: the new tokens land in blocks ``seq`` already holds alone.
            write_index = seq.num_computed_tokens // self.block_size
            if write_index >= len(held) or self.blocks[held[write_index]].ref_count == 1:
                return True
        num_computed = seq.num_computed_tokens + len(match.blocks) * self.block_size
        num_held = len(seq.block_ids) + len(match.blocks)
        num_fresh = max(0, self.blocks_needed(num_computed + num_new_tokens) - num_held)
        write_index = num_computed // self.block_size
        needs_copy = write_index < len(seq.block_ids) and self.blocks[seq.block_ids[write_index]].ref_count > 1
        num_revived = sum(1 for b in match.blocks if b.ref_count == 0)
        if num_fresh + int(needs_copy) + num_revived > len(self._free):
            return False
        if self._counts_as_query(seq):
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(match.blocks) * self.block_size
        for block in match.blocks:
            self._reference(block)
        seq.block_ids.extend(b.block_id for b in match.blocks)
        seq.block_hashes.extend(match.hashes)
        seq.num_computed_tokens = num_computed
        if needs_copy:
            self._copy_on_write(seq, write_index)
        for _ in range(num_fresh):
            seq.block_ids.append(self._take_free().block_id)
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_used_blocks)
        return True

    def _counts_as_query(self, seq: Sample) -> bool:
        """Whether admitting ``seq`` now counts as a prefix-cache query, as vLLM's ``vllm:prefix_cache_queries``.

        Once per request's first admission (a queue head that keeps failing to fit would otherwise be
        counted every step; a sequence re-admitted after preemption is not a new query), and only when
        the cache was looked up (prompt-logprobs requests skip it).
        """
        return (self.enable_prefix_caching and seq.num_computed_tokens == 0 and not seq.block_ids
                and seq.num_preemptions == 0 and seq.request.params.prompt_logprobs is None)

    def fork(self, parent: Sample, child: Sample, num_blocks: int | None = None) -> None:
        """Let ``child`` share every block of ``parent`` (or only its first ``num_blocks`` full, computed
        ones); writes will copy on demand."""
        shared = parent.block_ids if num_blocks is None else parent.block_ids[:num_blocks]
        child.block_ids = list(shared)
        child.block_hashes = parent.block_hashes[: len(shared)]
        child.num_computed_tokens = parent.num_computed_tokens if num_blocks is None else len(shared) * self.block_size
        for block_id in shared:
            self.blocks[block_id].ref_count += 1

    def free(self, seq: Sample) -> None:
        """Drop ``seq``'s references; tail blocks first so they are evicted first."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            if block.ref_count < 1:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = block
        seq.block_ids = []
        seq.block_hashes = []

    def cache_full_blocks(self, seq: Sample, num_computed: int | None = None) -> None:
        """Publish the content hash of every block of ``seq`` that is full and computed: within its first
        ``num_computed`` tokens (default ``seq.num_computed_tokens``).

        The scheduler passes the tokens a prefill chunk will have computed once the step it was just scheduled
        in ends: a request admitted later in the same step then matches those blocks, and its attention reads
        them in the same forward, after each layer has written the step's keys and values (as vLLM does).
        """
        computed_full = seq.num_computed_tokens // self.block_size
        num_full = computed_full if num_computed is None else num_computed // self.block_size
        if not self.enable_prefix_caching or num_full <= len(seq.block_hashes):  # most steps fill no block
            return
        run: list[Block] = []  # newly cached consecutive blocks, one BlockStored event each run
        run_start = 0
        for index in range(len(seq.block_hashes), num_full):
            start = index * self.block_size
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            key = block_key(seq.block_hashes[-1] if seq.block_hashes else None, tokens, seq.request.lora_int_id)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_ids[index]]
            # The parent is whichever block the cache holds for the previous key, as a
            # later match will walk through that one.
            parent = self._cached.get(seq.block_hashes[index - 1]) if index else None
            if block.block_hash is not None or key in self._cached or (index and parent is None):
                self._stored(seq, run, run_start)
                continue
            block.block_hash = key
            block.tokens = tokens
            block.parent = None if parent is None else (parent.block_id, parent.epoch)
            self._cached[key] = block
            if index >= computed_full:
                self._uncomputed.append(block)
            if self._events is not None:
                run_start = index if not run else run_start
                run.append(block)
        self._stored(seq, run, run_start)

    def step_computed(self) -> None:
        """The step ran: the blocks published ahead of it now hold their KV."""
        self._uncomputed.clear()

    def forget_uncomputed(self) -> set[int]:
        """The step failed: forget the blocks published ahead of it (their KV was never written), so no later
        request matches them; returns their ids."""
        forgotten = {block.block_id for block in self._uncomputed}
        for block in self._uncomputed:
            if block.block_hash is not None and self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self._events is not None:
                    self._events.append(BlockRemoved(block_hashes=[block.block_hash], medium=MEDIUM_GPU, group_idx=0))
                _forget(block)
        self._uncomputed.clear()
        return forgotten

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies the runner must do before this step's writes."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            _forget(block)
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())

    def cached_block_hashes(self) -> set[BlockKey]:
        """The keys of every cached block: what a consumer of this cache's events should hold."""
        return set(self._cached)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events recorded since the last call (none when events are off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KVCacheEvent]:
        """Events that bring a consumer from any state to this cache's: a clear, then every cached block,
        parents first (each with its token ids; the adapter is not kept per block, so none is named)."""
        depth: dict[int, int] = {}
        for block in self._cached.values():  # iteratively: a chain can be max_model_len / block_size long
            chain: list[Block] = []
            node: Block | None = block
            while node is not None and node.block_id not in depth:
                chain.append(node)
                node = self._live_parent(node)
            base = -1 if node is None else depth[node.block_id]
            for offset, member in enumerate(reversed(chain), start=1):
                depth[member.block_id] = base + offset

        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for block in sorted(self._cached.values(), key=lambda block: depth[block.block_id]):
            parent = self._live_parent(block)
            events.append(BlockStored(block_hashes=[block.block_hash], token_ids=list(block.tokens),
                                      parent_block_hash=None if parent is None else parent.block_hash,
                                      block_size=self.block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
                                      group_idx=0))
        return events

    def _live_parent(self, block: Block) -> Block | None:
        if block.parent is None:
            return None
        parent = self.blocks[block.parent[0]]
        return parent if parent.epoch == block.parent[1] and parent.block_hash is not None else None

    def _stored(self, seq: Sample, run: list[Block], first: int) -> None:
        """Record one BlockStored for ``run`` (blocks ``first``, ``first + 1``, ... of ``seq``, just cached) and
        empty it."""
        if not run:
            return
        lora_name = seq.request.lora_name
        self._events.append(BlockStored(  # type: ignore[union-attr]
            block_hashes=[block.block_hash for block in run],
            parent_block_hash=seq.block_hashes[first - 1] if first else None,
            token_ids=[token for block in run for token in block.tokens],
            block_size=self.block_size,
            lora_id=seq.request.lora_int_id or None,
            medium=MEDIUM_GPU,
            lora_name=lora_name,
            extra_keys=None if lora_name is None else [(lora_name,)] * len(run),
            group_idx=0,
        ))
        run.clear()

    def _reference(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def _take_free(self) -> Block:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self._events is not None:
                self._events.append(BlockRemoved(block_hashes=[block.block_hash], medium=MEDIUM_GPU, group_idx=0))
            _forget(block)
        block.ref_count = 1
        return block

    def _copy_on_write(self, seq: Sample, index: int) -> None:
        shared = self.blocks[seq.block_ids[index]]
        shared.ref_count -= 1
        private = self._take_free()
        self._pending_copies.append((shared.block_id, private.block_id))
        seq.block_ids[index] = private.block_id


def _forget(block: Block) -> None:
    """Drop a block's cached identity; blocks cached after it no longer verify against it."""
    block.block_hash = None
    block.tokens = ()
    block.parent = None
    block.epoch += 1
