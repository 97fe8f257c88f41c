"""Block hashes for automatic prefix caching.

A full KV block is named by SHA-256 over its parent block's hash and its own token ids,
so a hash stands for the whole prefix up to the block's end, not just its tokens. The
first block's parent is a salt that covers everything else the cached K/V depends on
(the model, its revision, dtype and quantisation, the load format): two engines, or one
engine before and after its weights change, never share a name. SHA-256 rather than
Python's ``hash``: a collision would silently splice another prompt's K/V into this
one, so it must be as unlikely as a cryptographic collision.

Called only by the engine's KVBlockManager, in the engine process; workers never see a
hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def prefix_cache_salt(*parts: object) -> BlockHash:
    """The root of every hash chain: a digest of ``parts`` (their reprs, in order)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block: ``parent`` is the previous block's hash, or the
    salt for the first block."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()
