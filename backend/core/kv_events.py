"""KV cache events in vLLM's wire format (``vllm/distributed/kv_events.py``), for routers that track replicas' caches.

The structs below are vLLM's, field for field and in the same order, with the same msgspec
options: an ``EventBatch`` is a msgpack array ``[ts, events, data_parallel_rank]``; each event
is a tagged array whose first element is its class name. So vLLM's own decoder
(``msgspec.msgpack.Decoder(KVEventBatch)``), vllm-router's ``kv_aware`` index, llm-d's KV
indexer and Dynamo's ZMQ relay read pagedllm's events as they read vLLM's.

When the KV cache manager emits them (``pagedllm.core.kv_cache_manager``), as vLLM's block pool does:

- ``BlockStored``: full, computed blocks of one sequence became cached (one event per run of
  consecutive new blocks): their content keys, the key of the block before the run (``None``
  at the start of a sequence), their token ids, the block size, and the LoRA adapter, which is
  part of the keys (``lora_id``, ``lora_name``, and ``extra_keys``: ``(lora_name,)`` per block,
  the untagged form vLLM publishes). Nothing else shapes a pagedllm block key.
- ``BlockRemoved``: a cached block was evicted (handed out again), one event per block.
- ``AllBlocksCleared``: the prefix cache was reset, or the engine started (so a router that
  followed an earlier incarnation of this replica forgets what that one held).

Block hashes are pagedllm's own keys (32-byte sha256 chains, ``pagedllm.core.block_hash``), sent
as bytes, which vLLM's ``ExternalBlockHash`` allows. Routers match requests by hashing the token
ids of each ``BlockStored`` themselves (vllm-router: sha256 of each block's tokens, seeded by
``lora_name``, chained through ``parent_block_hash``), so they need no knowledge of our keys.
"""
from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV cache, on whatever device it lives

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
