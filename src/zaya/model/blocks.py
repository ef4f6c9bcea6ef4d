"""Host-side bookkeeping of a slot decoder's KV blocks: which are free, how many sequences hold each, and which hold
a cached prompt prefix that a later sequence may reuse.

Block 0 is never handed out: it is the null block that unused block-table entries point at and that idle rows of a
decode step write into. A block is in one of three states:

- free (on a min-heap: the lowest free block is taken first, so the blocks ever written, and with them the memory
  a CPU process has touched, stay a compact low range);
- held by one or more sequences (``refs`` > 0);
- idle: no one holds it, but it carries a registered prefix ``key`` (``register``), so a new sequence with the same
  prefix can take it back (``hold``) instead of recomputing it. Idle blocks are reclaimed least recently released
  first when no free block is left (``allocate``), and then lose their key.

The keys themselves (a digest of the whole token prefix up to the block's end) are the caller's
(``zaya.serve.prefix_cache``); here a key is any hashable value, compared exactly.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable


class OutOfBlocksError(RuntimeError):
    """No free or idle block is left: the caller admitted more than the pool holds (a scheduling bug)."""


class BlockPool:
    """``num_blocks`` blocks, block 0 reserved (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), not {num_blocks}")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free = list(range(1, num_blocks))  # sorted, hence a valid heap
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self.evictions = 0
        """Idle cached blocks reclaimed for new tokens so far."""

    @property
    def usable(self) -> int:
        """Blocks that can hold tokens (all but the null block)."""
        return self.num_blocks - 1

    def available(self) -> int:
        """Blocks a new allocation can take: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    def held(self) -> int:
        """Blocks some sequence holds."""
        return self.usable - self.available()

    def cached(self) -> int:
        """Blocks that carry a prefix key (held or idle)."""
        return len(self._key_of)

    def allocate(self) -> int:
        """A block for new tokens, held once: the lowest free block, else the least recently released idle one
        (which loses its key)."""
        if self._free:
            block = heapq.heappop(self._free)
        elif self._idle:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.evictions += 1
        else:
            raise OutOfBlocksError(f"all {self.usable} KV blocks are held")
        self.refs[block] = 1
        return block

    def lookup(self, key: Hashable) -> int | None:
        """The block registered under ``key``, held or idle; None if there is none."""
        return self._block_of.get(key)

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def hold(self, block: int) -> None:
        """One more holder of a registered ``block`` (taken back from the idle list if no one held it)."""
        if self.refs[block] == 0:
            if block not in self._idle:
                raise ValueError(f"block {block} is free: only a registered block can be held again")
            del self._idle[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; a block no one holds becomes idle if registered, else free."""
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is not held")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._key_of:
                self._idle[block] = None
            else:
                heapq.heappush(self._free, block)

    def register(self, block: int, key: Hashable) -> bool:
        """Record that held ``block`` holds the prefix ``key``; False (and nothing changes) when another block
        already holds it (two sequences computed the same prefix at once) or this block has a key already."""
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is not held: only a block being written can be registered")
        if key in self._block_of or block in self._key_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True
