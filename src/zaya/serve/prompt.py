"""Tokenizing a client's prompt without stalling the server or filling its memory.

A ``tokenizers`` backend's ``encode`` holds Python's GIL for the whole text (12 s for a 4 MB prompt here: the event
loop and the engine thread stop with it), and keeps offsets for every token (1 GB for that prompt). ``encode_prompt``
encodes through ``Tokenizer.encode_fast``, which releases the GIL and keeps no offsets, and a text too long for the
context is refused after its first chunks rather than encoded whole: it is counted chunk by chunk, and once the count
passes the context (with a margin for the tokens a chunk boundary can add) it is a ``ContextLengthError``. A text
that may fit is then encoded whole, so its ids are exactly the backend's. A text the tokenizer fails on (a Rust
panic) is a ``zaya.data.tokenizer.TokenizerFailure``.
"""

from __future__ import annotations

from zaya.serve.engine import ContextLengthError

CHUNK_CHARS = 1 << 16
BOUNDARY_SLACK = 64
"""Tokens one chunk boundary may add to the count (a word split in two, a prefix a pre-tokenizer adds)."""


def encode_prompt(tokenizer, text: str, capacity: int, special_tokens: bool = False) -> list[int]:
    """``text``'s ids (``tokenizer.encode_fast(text, special_tokens)``), or ``ContextLengthError`` when it certainly
    has more than ``capacity`` tokens."""
    if len(text) > CHUNK_CHARS:
        count = 0
        for i, start in enumerate(range(0, len(text), CHUNK_CHARS), start=1):
            count += len(tokenizer.encode_fast(text[start:start + CHUNK_CHARS], special_tokens))
            if count > capacity + BOUNDARY_SLACK * i:
                raise ContextLengthError(f"this model's context is {capacity} tokens; the prompt has more than "
                                         f"{count - BOUNDARY_SLACK * i} (its first {start + CHUNK_CHARS} of "
                                         f"{len(text)} characters)")
    return tokenizer.encode_fast(text, special_tokens)
