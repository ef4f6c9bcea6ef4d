"""Incremental detokenization with stop strings, for streaming.

Text is re-decoded from all output ids each time (a byte-level BPE token can end in the middle of a UTF-8
character, so decoding tokens one by one would garble it), and what is released is held back while its end could
still be the start of a stop string or ends in an incomplete character (U+FFFD). Cost: one decode of the output so far
per token, which is small next to a model step at the lengths served here.
"""

from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    """Feed it the output ids after every token; it says what new text may be sent and whether a stop matched."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self.sent = 0
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int]) -> str:
        """The text newly safe to send after ``ids`` (the whole output so far); sets ``stopped`` on a stop string
        (the text is then cut before it)."""
        text = self.decode(ids)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            return self._release(len(self.text))
        self.text = text
        safe = len(text) - held_back(text, self.stops)
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._release(max(safe, self.sent))

    def finish(self) -> str:
        """The rest of the text, at the end of the output."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start of one of ``stops`` (held back until it is known
    whether the stop follows)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
