"""KVBlockManager accounting: allocation, growth, freeing."""

from __future__ import annotations

import pytest

from config import SamplingParams
from engine.block_manager import KVBlockManager
from engine.request import Request


def make_request(req_id: str, num_prompt: int = 4) -> Request:
    return Request(req_id, list(range(1, num_prompt + 1)), SamplingParams())


def test_initial_state() -> None:
    bm = KVBlockManager(num_blocks=8, block_size=4)
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0


def test_blocks_needed_rounds_up_and_counts_held_blocks() -> None:
    bm = KVBlockManager(num_blocks=8, block_size=4)
    req = make_request("a")
    assert bm.blocks_needed(req, 0) == 0
    assert bm.blocks_needed(req, 1) == 1
    assert bm.blocks_needed(req, 4) == 1
    assert bm.blocks_needed(req, 5) == 2
    assert bm.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    # 5 computed + 3 new = 8 tokens = 2 blocks, already held.
    assert bm.blocks_needed(req, 3) == 0
    assert bm.blocks_needed(req, 4) == 1


def test_allocate_grows_table_and_accounts() -> None:
    bm = KVBlockManager(num_blocks=8, block_size=4)
    req = make_request("a")
    assert bm.allocate_slots(req, 6)
    assert len(req.block_ids) == 2
    assert bm.num_free_blocks == 6
    assert bm.usage == pytest.approx(2 / 8)
    req.num_computed_tokens = 6
    first_table = list(req.block_ids)
    assert bm.allocate_slots(req, 1)  # slot 7 fits in block 2
    assert req.block_ids == first_table
    req.num_computed_tokens = 8
    assert bm.allocate_slots(req, 1)  # slot 9 needs a third block
    assert req.block_ids[:2] == first_table and len(req.block_ids) == 3
    assert bm.num_free_blocks == 5


def test_allocation_failure_changes_nothing() -> None:
    bm = KVBlockManager(num_blocks=3, block_size=2)
    a, b = make_request("a"), make_request("b")
    assert bm.allocate_slots(a, 4)
    assert not bm.allocate_slots(b, 4)  # needs 2, only 1 free
    assert b.block_ids == []
    assert bm.num_free_blocks == 1
    assert bm.allocate_slots(b, 2)


def test_no_block_is_given_to_two_requests() -> None:
    bm = KVBlockManager(num_blocks=10, block_size=2)
    requests = [make_request(str(i)) for i in range(5)]
    for req in requests:
        assert bm.allocate_slots(req, 4)
    held = [b for req in requests for b in req.block_ids]
    assert sorted(held) == list(range(10))
    assert bm.num_free_blocks == 0
    assert not bm.allocate_slots(make_request("x"), 1)


def test_free_returns_blocks_and_is_idempotent() -> None:
    bm = KVBlockManager(num_blocks=4, block_size=2)
    a, b = make_request("a"), make_request("b")
    assert bm.allocate_slots(a, 4) and bm.allocate_slots(b, 4)
    bm.free(a)
    assert a.block_ids == []
    assert bm.num_free_blocks == 2
    bm.free(a)  # second free is a no-op
    assert bm.num_free_blocks == 2
    # Freed blocks are reusable and never collide with b's.
    c = make_request("c")
    assert bm.allocate_slots(c, 4)
    assert set(c.block_ids).isdisjoint(b.block_ids)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0


def test_freeing_a_free_block_is_an_error() -> None:
    bm = KVBlockManager(num_blocks=2, block_size=2)
    a = make_request("a")
    assert bm.allocate_slots(a, 2)
    forged = make_request("forged")
    forged.block_ids = list(a.block_ids)
    bm.free(a)
    with pytest.raises(RuntimeError, match="already free"):
        bm.free(forged)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_invalid_construction(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        KVBlockManager(num_blocks=num_blocks, block_size=block_size)
