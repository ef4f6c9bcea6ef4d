"""Keys of cached prompt prefixes: which KV blocks (``zaya.model.blocks``) a new request may reuse.

A full block of ``block_size`` tokens is keyed by a digest of every token from the start of the sequence to the
block's end (chained: the previous block's key, then this block's tokens), so two blocks share a key exactly when
their whole prefixes are equal. The digest is BLAKE2b (16 bytes): a key is compared by value, and a collision,
which would hand one client's cached keys to another's prompt, cannot be constructed on purpose (a tuple hash
could).
"""

from __future__ import annotations

import hashlib
from array import array


def next_key(previous: bytes, tokens: list[int]) -> bytes:
    """The key of the block holding ``tokens`` after the prefix keyed ``previous`` (b"" for the first block)."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()
