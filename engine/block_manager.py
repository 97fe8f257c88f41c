"""Paged KV-cache block accounting, with automatic prefix caching.

Used by the Scheduler, in the engine process only: workers receive block tables and
never know whether a block is shared.

With ``enable_caching``, a block that a request fills (every token in it computed, or
being computed in the step just scheduled) is registered under its hash
(engine/block_hash.py). A new request first takes the
longest run of registered blocks that prefixes its tokens (sharing them, by reference
count) and computes only the rest. A block nobody holds any more keeps its K/V and its
name, in an LRU list; it is overwritten only when no never-used or unnamed free block
is left. A named block's K/V is written once, in the step that named it, by the request
that named it; a request's new tokens never land in a block named before, because only
whole blocks are shared and at least one token of every request is computed.

A request's ``cache_salt`` roots its hash chain elsewhere, so it shares blocks only with
requests of the same salt. The samples of one prompt (``sibling_group``) share their
prompt's blocks even with caching off, under a root only they know; such a block is
forgotten as soon as no sample holds it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from distributed.utils import cdiv
from engine.block_hash import BlockHash, hash_block_tokens, prefix_cache_salt
from engine.request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative counts, in tokens: ``queries`` looked up at admission, ``hits`` found
    cached; ``evictions`` counts cached blocks overwritten."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


class KVBlockManager:
    """Hands out fixed-size KV blocks ``0..num_blocks-1``.

    Invariants: a block is free (in exactly one of the two free lists, with reference
    count 0) or held by the requests that list it in ``block_ids`` (count = how many);
    a request holds exactly ``ceil(tokens_covered / block_size)`` blocks after
    :meth:`allocate_slots`; a named block's K/V is that of the tokens its hash names.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False, hash_salt: BlockHash = b""
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_salt = hash_salt
        self.stats = PrefixCacheStats()
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        # FIFO reuse spreads writes over the cache; any order would be correct.
        self._free: deque[int] = deque(range(num_blocks))
        # Free but named blocks, least recently freed first: the eviction order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take, cached-but-unused ones included."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def ref_counts(self) -> tuple[int, ...]:
        """How many requests hold each block (a copy; for checks and debugging)."""
        return tuple(self._ref_cnt)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV."""
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks ``request`` needs to cover ``num_computed_tokens + num_new_tokens``."""
        total = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_ids))

    # ------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks that prefix ``request``'s tokens: the longest run of named
        full blocks, leaving at least its last token to compute (its logits are the
        ones sampled). Empty unless caching is on and the request holds no blocks.
        Changes nothing but the request's memo of its block hashes."""
        if not self._caches(request) or request.block_ids:
            return []
        hits: list[int] = []
        for block_hash in self._block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name every block of ``request`` that its first ``num_tokens`` tokens fill.

        The scheduler calls it when it schedules those tokens, before their step runs:
        every attention backend writes a step's K/V into the cache before any sequence
        of that step attends, so a request admitted in the same step may already share
        these blocks (a burst of prompts with one system prompt computes it once)."""
        if not self._caches(request):
            return
        num_full = num_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            block = request.block_ids[i]
            # A prefix computed twice at once (two equal prompts in one step) keeps its
            # first block's name; the twin stays unnamed and is reused first.
            if self._block_hash[block] is None and hashes[i] not in self._cached:
                self._block_hash[block] = hashes[i]
                self._cached[hashes[i]] = block
        request.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> int:
        """Forget every name: no later request hits a block cached before. Blocks in use
        stay with their requests (and are reused like any unnamed block once freed).
        Returns how many blocks were named."""
        dropped = len(self._cached)
        for block in self._cached.values():
            self._block_hash[block] = None
        self._cached.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        return dropped

    def _caches(self, request: Request) -> bool:
        """Caching is on, or the request is one of several samples of one prompt, which
        share their prompt's blocks (under a root only they know) even when it is off."""
        return self.enable_caching or request.sibling_group is not None

    def _root(self, request: Request) -> BlockHash:
        """The parent of a request's first block: the engine's salt, extended by the
        request's ``cache_salt`` and, with caching off, by its sibling group."""
        group = None if self.enable_caching else request.sibling_group
        if request.cache_salt is None and group is None:
            return self.hash_salt
        return prefix_cache_salt(self.hash_salt, request.cache_salt, group)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The hashes of the request's first ``num_blocks`` full blocks, extending its memo."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            tokens = request.all_token_ids
            size = self.block_size
            parent = hashes[-1] if hashes else self._root(request)
            for i in range(len(hashes), num_blocks):
                parent = hash_block_tokens(parent, tokens[i * size : (i + 1) * size])
                hashes.append(parent)
        return hashes[:num_blocks]

    # -------------------------------------------------------------- allocation

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Grow ``request.block_ids`` to cover its computed plus new tokens.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, at admission) go first in
        the table, shared, and their tokens count as computed; ``num_new_tokens`` are
        the tokens after them. All-or-nothing: returns False and changes nothing if
        there are not enough free blocks.
        """
        if computed_blocks and request.block_ids:
            raise ValueError(f"{request.request_id!r} already holds blocks; cached blocks come only at admission")
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_for_tokens(num_computed + num_new_tokens) - len(request.block_ids) - len(computed_blocks)
        # A cached block nobody holds is counted free; taking it as a hit uses it up.
        reclaimed = sum(1 for block in computed_blocks if self._ref_cnt[block] == 0)
        if needed > self.num_free_blocks - reclaimed:
            return False
        for block in computed_blocks:
            if self._ref_cnt[block] == 0:
                del self._evictable[block]
            self._ref_cnt[block] += 1
            request.block_ids.append(block)
        if computed_blocks:
            request.num_computed_tokens = num_computed
            request.num_cached_blocks = len(computed_blocks)
        for _ in range(needed):
            request.block_ids.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_hash[block]]  # type: ignore[index]
            self._block_hash[block] = None
            self.stats.evictions += 1
        self._ref_cnt[block] = 1
        return block

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix lookup (the scheduler calls it when the request
        is actually admitted, so a request waiting for room is counted once)."""
        if self.enable_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release all of ``request``'s blocks and clear its table. Idempotent.

        Its named blocks become evictable tail first: a block is worth nothing without
        the blocks before it, so the end of a prefix should go before its start."""
        for block in reversed(request.block_ids):
            if self._ref_cnt[block] <= 0:
                # A block freed twice would later be handed to two requests,
                # silently corrupting both KV caches; fail loudly instead.
                raise RuntimeError(f"block {block} of {request.request_id!r} is already free")
            self._ref_cnt[block] -= 1
            if self._ref_cnt[block] == 0:
                if self._block_hash[block] is not None and self.enable_caching:
                    self._evictable[block] = None
                elif self._block_hash[block] is not None:  # a sibling group's block: no one else can hit it
                    del self._cached[self._block_hash[block]]
                    self._block_hash[block] = None
                    self._free.append(block)
                else:
                    self._free.append(block)
        request.block_ids = []
        request.num_cached_blocks = 0
