"""Structured output: a ``TokenConstraint`` that lets a request sample only the tokens a grammar allows next.

Grammars are llguidance's (a JSON schema, or a Lark grammar that embeds JSON schemas: ``zaya.serve.tools``). It was
chosen over xgrammar and outlines-core (docs/serving.md, "Structured output"): it has no dependencies (xgrammar
pulls triton, transformers and a TVM runtime), it reads the served ``tokenizer.json`` itself (byte-level BPE,
byte fallback, added tokens), it covers JSON schema widely (nested objects, arrays, enums, numeric ranges,
``required``, ``additionalProperties``, ``anyOf``, ``$ref``), and it computes each mask lazily from the parser's state
(tens to a few hundred microseconds a token on a 32k-262k vocabulary) rather than compiling the grammar against
the whole vocabulary up front.

``Grammars`` belongs to one server: it wraps the tokenizer for llguidance once (about a second for a 262k
vocabulary, on the first structured request), checks and compiles each distinct grammar once (a bounded
least-recently-used cache of ready matchers) and hands each request a copy. ``GrammarConstraint.mask`` forbids
every token the grammar does not allow now, every id past the tokenizer's vocabulary (a model's may be larger), and
eos until the grammar may end; ``accept`` advances it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch

MAX_SCHEMA_BYTES = 64 << 10
"""The largest JSON schema (or tool's parameters schema) served, as compact JSON."""
CACHE_SIZE = 64
"""Distinct compiled grammars kept (a copy of one is a request's constraint)."""
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How constrained JSON is spelled: one space after ``,`` and ``:`` (as Python's ``json.dumps`` and the chat
template's ``tojson`` write it), no other whitespace, so a response is never padded with blanks."""
JSON_OBJECT = {"type": "object"}
"""``response_format: {"type": "json_object"}``: any JSON object."""


class GrammarError(ValueError):
    """A schema or grammar llguidance refuses (or one too large); the message says why."""


def schema_text(schema: dict) -> str:
    """``schema`` as compact JSON (``GrammarError`` when it nests too deeply to be written)."""
    try:
        return json.dumps(schema, separators=(",", ":"))
    except RecursionError:
        raise GrammarError("the schema nests too deeply") from None


def json_schema_grammar(schema: dict) -> str:
    """The grammar of the JSON values ``schema`` describes (``GrammarError`` when it is too large)."""
    from llguidance import LLMatcher

    text = schema_text(schema)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the schema has {len(text.encode()):,} bytes as JSON; at most {MAX_SCHEMA_BYTES:,} "
                           "are served")
    try:
        return LLMatcher.grammar_from_json_schema(text, overrides=JSON_FORMAT)
    except ValueError as exc:  # e.g. nested past its parser's recursion limit
        raise GrammarError(str(exc)) from None


class GrammarConstraint:
    """One request's ``TokenConstraint`` (``zaya.serve.request``) over an llguidance matcher of its own."""

    def __init__(self, matcher, tokenizer_size: int) -> None:
        self.matcher = matcher
        self.size = tokenizer_size

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [1, V] (not changed) with the forbidden tokens at -inf: the matcher's bitmask (one bit per
        tokenizer id, little-endian) unpacked on the host, every id past the tokenizer forbidden."""
        packed = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")
        n = min(self.size, logits.shape[-1])
        forbidden = np.ones(logits.shape[-1], np.bool_)
        np.equal(np.unpackbits(packed, count=n, bitorder="little"), 0, out=forbidden[:n])
        return logits.masked_fill(torch.from_numpy(forbidden).to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")


class Grammars:
    """Grammars over one served tokenizer (``zaya.data.tokenizer.Tokenizer``) whose end is ``eos_token_id``.
    Thread-safe: requests are built on several threads."""

    def __init__(self, tokenizer, eos_token_id: int, cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer, self.eos, self.cache_size = tokenizer, eos_token_id, cache_size
        self._llg_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _wrapped(self):
        """The tokenizer as llguidance reads it (built once, on first use)."""
        if self._llg_tokenizer is None:
            from llguidance import LLTokenizer

            self._llg_tokenizer = LLTokenizer(self.tokenizer.backend.to_str(), eos_token=self.eos)
        return self._llg_tokenizer

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for ``grammar`` (``GrammarError`` naming why llguidance refuses it)."""
        from llguidance import LLMatcher

        with self._lock:
            wrapped = self._wrapped()
            ready = self._compiled.get(grammar)
            if ready is None:
                problem = LLMatcher.validate_grammar(grammar, wrapped)
                if problem:
                    raise GrammarError(problem)
                ready = LLMatcher(wrapped, grammar, log_level=0)
                if ready.is_error():
                    raise GrammarError(ready.get_error())
                self._compiled[grammar] = ready
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
            return GrammarConstraint(ready.deep_copy(), wrapped.vocab_size)
