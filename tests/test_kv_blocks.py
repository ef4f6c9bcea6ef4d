"""The KV block pool's bookkeeping (``zaya.model.blocks``): lowest free block first, shared and cached blocks,
least-recently-released eviction, and the errors a scheduling bug would meet."""

from __future__ import annotations

import pytest

from zaya.model.blocks import BlockPool, OutOfBlocksError


def test_blocks_are_handed_out_lowest_first_and_come_back():
    pool = BlockPool(5)
    assert pool.usable == 4 and pool.available() == 4
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (1, 2, 3) and pool.held() == 3
    pool.release(b)
    assert pool.allocate() == 2  # the lowest free one again, not 4
    pool.release(a)
    pool.release(2)
    pool.release(c)
    assert pool.available() == 4 and pool.held() == 0
    with pytest.raises(ValueError, match="block 3 is not held"):
        pool.release(3)


def test_registered_blocks_are_shared_kept_idle_and_evicted_oldest_first():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(3)]
    for block, key in zip(blocks, "xyz"):
        assert pool.register(block, key)
    assert not pool.register(blocks[0], "other")  # one key per block
    assert pool.lookup("y") == blocks[1] and pool.lookup("w") is None
    pool.hold(blocks[1])  # a second sequence shares it
    pool.release(blocks[1])
    assert pool.refs[blocks[1]] == 1 and not pool.is_idle(blocks[1])
    for block in (blocks[2], blocks[0], blocks[1]):  # released in this order: z, x, y
        pool.release(block)
    assert pool.available() == 3 and pool.cached() == 3 and all(pool.is_idle(b) for b in blocks)
    pool.hold(pool.lookup("x"))  # taken back from the idle list: no longer evictable
    assert pool.allocate() == blocks[2] and pool.lookup("z") is None  # the least recently released one goes
    assert pool.allocate() == blocks[1] and pool.evictions == 2
    with pytest.raises(OutOfBlocksError, match="all 3 KV blocks are held"):
        pool.allocate()
    assert pool.register(blocks[1], "y2") and not pool.register(blocks[2], "y2")  # a key already held elsewhere
    pool.release(blocks[2])  # unregistered: free again, not idle
    with pytest.raises(ValueError, match="is free: only a registered block"):
        pool.hold(blocks[2])
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)
