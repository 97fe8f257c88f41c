"""Paged KV-cache block accounting (no prefix caching)."""

from __future__ import annotations

from collections import deque

from distributed.utils import cdiv
from engine.request import Request


class KVBlockManager:
    """Hands out fixed-size KV blocks ``0..num_blocks-1`` from a free list.

    Invariants: every block is either in the free list or in exactly one
    request's ``block_ids``; a request holds exactly
    ``ceil(tokens_covered / block_size)`` blocks after :meth:`allocate_slots`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse spreads writes over the cache; any order would be correct.
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free: list[bool] = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks currently allocated, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV."""
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks ``request`` needs to cover ``num_computed_tokens + num_new_tokens``."""
        total = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= len(self._free)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_ids`` to cover its computed plus new tokens.

        All-or-nothing: returns False and changes nothing if there are not
        enough free blocks.
        """
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block = self._free.popleft()
            self._is_free[block] = False
            request.block_ids.append(block)
        return True

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks and clear its table. Idempotent."""
        for block in request.block_ids:
            if self._is_free[block]:
                # A block freed twice would later be handed to two requests,
                # silently corrupting both KV caches; fail loudly instead.
                raise RuntimeError(f"block {block} of {request.request_id!r} is already free")
            self._is_free[block] = True
            self._free.append(block)
        request.block_ids = []
