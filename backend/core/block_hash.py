"""Content keys of full KV blocks for prefix caching.

A key chains the parent block's key with the block's token ids through
sha256, so equal keys mean equal prefixes up to and including this block.
Python's ``hash`` of a tuple would be cheap but collidable on purpose (the
class of vLLM's CVE-2025-25183): one client could then read another's KV.
The cache manager still checks a hit's tokens and parent before reusing it,
so even a broken hash can only cost a miss, never a wrong block.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockKey = bytes

_ROOT = b"pagedllm-prefix-v1"


def block_key(parent: BlockKey | None, token_ids: Sequence[int], lora_int_id: int = 0) -> BlockKey:
    """Key of a full block holding ``token_ids`` after the prefix whose last block has key ``parent``.

    ``lora_int_id``: the adapter the K/V was computed under (0: the base model); it seeds the first block's key,
    so every key of the chain differs between adapters.
    """
    if parent is None:
        parent = _ROOT if lora_int_id == 0 else _ROOT + b"lora" + lora_int_id.to_bytes(8, "little")
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()
