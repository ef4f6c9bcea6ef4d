"""Tokenizing a client's prompt without stalling the server or filling its memory.

A ``tokenizers`` backend's ``encode`` holds Python's GIL for the whole text (12 s for a 4 MB prompt here: the event
loop and the engine thread stop with it), and keeps offsets for every token (1 GB for that prompt). ``encode_prompt``
encodes through ``encode_batch_fast``, which releases the GIL and keeps no offsets, and a text too long for the
context is refused after its first chunks rather than encoded whole: it is counted chunk by chunk, and once the count
passes the context (with a margin for the tokens a chunk boundary can add) it is a ``ContextLengthError``. A text
that may fit is then encoded whole, so its ids are exactly the backend's.
"""

from __future__ import annotations

from zaya.serve.engine import ContextLengthError

CHUNK_CHARS = 1 << 16
BOUNDARY_SLACK = 64
"""Tokens one chunk boundary may add to the count (a word split in two, a prefix a pre-tokenizer adds)."""


def encode(backend, text: str) -> list[int]:
    """``text``'s ids with no special tokens added (as ``backend.encode(text, add_special_tokens=False).ids``),
    with the GIL released while it runs."""
    fast = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    try:
        return fast([text], add_special_tokens=False)[0].ids
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a Rust panic is a BaseException: make it an error this request reports
        raise RuntimeError(f"the tokenizer failed on this text: {type(exc).__name__}: {exc}") from None


def encode_prompt(backend, text: str, capacity: int) -> list[int]:
    """``text``'s ids, or ``ContextLengthError`` when it certainly has more than ``capacity`` tokens."""
    if len(text) > CHUNK_CHARS:
        count = 0
        for i, start in enumerate(range(0, len(text), CHUNK_CHARS), start=1):
            count += len(encode(backend, text[start:start + CHUNK_CHARS]))
            if count > capacity + BOUNDARY_SLACK * i:
                raise ContextLengthError(f"this model's context is {capacity} tokens; the prompt has more than "
                                         f"{count - BOUNDARY_SLACK * i} (its first {start + CHUNK_CHARS} of "
                                         f"{len(text)} characters)")
    return encode(backend, text)
