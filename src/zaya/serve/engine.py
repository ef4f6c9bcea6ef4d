"""The inference engine: requests on slots, continuous batching, chunked prefill, one batched decode step.

``Engine(model, num_slots, capacity)`` builds the model's slot decoder (``zaya.model.slots.SlotDecoder``: per slot a KV cache
plus the CCA convolution and value-shift state, allocated once). ``submit`` queues a ``Request``; each ``step``:

1. admits waiting requests into free slots (the lowest free one first, which keeps the decoding rows packed at
   the front, so a decode step spans few idle rows);
2. prefills at most ``prefill_chunk`` prompt tokens in all, oldest request first (several short prompts, or one
   chunk of a long one), so a long prompt delays the running streams by one chunk per step, not by its length;
3. runs one decode step over every decoding slot: one forward with one token per row, each at its own position;
4. samples every request that got logits (per-request temperature / top-k / top-p / repetition, presence and
   frequency penalties / seed, then the request's ``constraint`` (structured output) if it has one;
   log-probabilities stay those of the raw logits),
   reads the sampled ids back to the host (the step's one read, with the log-probabilities when asked for), and
   applies eos, stop strings and max_tokens. A finished request frees its slot at once; the next step can give it
   to a waiting request (requests join and leave between steps).

With ``speculative_ngram`` > 0, a step in which one request decodes alone (no other decoding, nothing prefilling)
drafts up to ``speculative_tokens`` tokens from its own context and verifies them in one forward
(``zaya.serve.speculative``): the same output distribution (greedy: the same tokens), several tokens per forward
when the continuation repeats the context.

One request never fails another: an exception while admitting, prefilling, sampling or finishing one request
finishes that request alone (finish reason "error", ``Request.error`` says why, the traceback goes to the
``zaya.serve`` log); the step goes on for the others, which produce what they would have alone (each samples with
its own generator). Only a failure of the batched decode forward, which no one request owns, fails the requests
decoding in it.

``generate_batch`` (behind ``zaya.serve.generate.generate``) runs a fixed batch on the same slot decoder and decode step, with
the rows sampled together through ``decode_tokens`` and no host read per token.

The engine is not thread-safe: one thread drives it (``zaya.serve.server`` runs it on a worker thread).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from zaya.model.slots import SlotDecoder
from zaya.serve.prefix_cache import next_key
from zaya.serve.request import Request, TokenLogprob
from zaya.serve.sampling import (MIN_TEMPERATURE, SamplingParams, apply_output_penalties, apply_repetition_penalty,
                                 decode_tokens, sample_next, sampling_probs)
from zaya.serve.speculative import CcaSnapshot, propose, verify_draft
from zaya.serve.text import TextStream

log = logging.getLogger("zaya.serve")


class ContextLengthError(ValueError):
    """A request that cannot fit in a slot: its prompt plus max_tokens exceed the engine's capacity."""


@dataclass
class _Active:
    request: Request
    slot: int
    generator: torch.Generator | None
    stream: TextStream | None
    blocks: int = 0
    """KV blocks the request may need in all (prompt + max_tokens): admission promised them."""
    prefilled: int = 0
    """Prompt tokens in the cache so far."""
    registered: int = 0
    """Leading blocks registered for prefix caching (or attached from it)."""
    last_key: bytes = b""
    """The prefix key of the last registered block (``zaya.serve.prefix_cache``)."""
    next_token: int | None = None
    """The last sampled token, to be fed by the next decode step."""
    seen: torch.Tensor | None = None
    """[V] bool: tokens of the prompt and output (repetition penalty only)."""
    counts: torch.Tensor | None = None
    """[V] how often each token is in the output, on the device (presence / frequency penalties only)."""
    pending: list = field(default_factory=list)


class Engine:
    """Continuous-batching engine over ``num_slots`` slots of ``capacity`` tokens (default: the model's
    max_seq_len), whose keys and values share a pool of ``kv_blocks`` blocks of ``block_size`` tokens (default:
    enough for every slot's whole capacity). ``decode`` (token ids -> text) is needed for stop strings.
    ``prefix_caching`` reuses the blocks of prompt prefixes computed before. ``speculative_ngram`` > 0 turns on
    prompt-lookup speculation (n-grams of up to that many tokens, ``speculative_tokens`` drafted per step).
    ``compile``: the decode step runs under ``torch.compile`` (``zaya.model.slots``)."""

    def __init__(self, model, num_slots: int = 16, capacity: int | None = None, prefill_chunk: int = 512,
                 decode: Callable[[list[int]], str] | None = None, speculative_ngram: int = 0,
                 speculative_tokens: int = 4, block_size: int = 16, kv_blocks: int | None = None,
                 prefix_caching: bool = True, compile: bool = False) -> None:
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if speculative_ngram < 0 or speculative_tokens < 1:
            raise ValueError(f"speculative_ngram must be >= 0 and speculative_tokens >= 1, not {speculative_ngram} "
                             f"and {speculative_tokens}")
        self.speculative_ngram = speculative_ngram
        self.speculative_tokens = speculative_tokens
        self.drafted = 0
        """Draft tokens verified so far (speculation)."""
        self.accepted = 0
        """Draft tokens kept so far (speculation)."""
        self.model = model
        self.capacity = capacity or model.config.max_seq_len
        self.num_slots = num_slots
        self.decoder = SlotDecoder(model, num_slots, self.capacity, block_size=block_size, num_blocks=kv_blocks,
                                   prefix_states=prefix_caching, compile=compile)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.prefix_queried = 0
        """Prompt tokens looked up in the prefix cache so far."""
        self.prefix_hits = 0
        """Prompt tokens found there (not computed again)."""
        self.device = self.decoder.device
        self.vocab_size = model.config.vocab_size
        self.prefill_chunk = prefill_chunk
        self.decode = decode
        self.waiting: deque[Request] = deque()
        self.slots: list[_Active | None] = [None] * num_slots
        self._prefill_order: deque[_Active] = deque()
        self.steps = 0
        self._last_chunk = 0

    # ------------------------------------------------------------------------------------------- requests
    def check(self, request: Request) -> None:
        """Raise ValueError (``ContextLengthError`` for length) for a request this engine cannot serve."""
        if not request.prompt:
            raise ValueError("the prompt has no tokens")
        if not _is_int(request.max_tokens) or request.max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, not {request.max_tokens!r}")
        if not all(_is_int(t) for t in request.prompt):
            raise ValueError("the prompt's token ids must be ints")
        if not isinstance(request.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, not {type(request.sampling).__name__}")
        low, high = min(request.prompt), max(request.prompt)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"prompt holds token id {high if high >= self.vocab_size else low}, outside "
                             f"[0, vocab_size={self.vocab_size})")
        if len(request.prompt) + request.max_tokens > self.capacity:
            raise ContextLengthError(f"this model's context is {self.capacity} tokens; the prompt has "
                                     f"{len(request.prompt)} and max_tokens is {request.max_tokens}")
        blocks, usable = self._blocks_for(request), self.decoder.pool.usable
        if blocks > usable:
            raise ContextLengthError(f"the prompt ({len(request.prompt)} tokens) and max_tokens ({request.max_tokens}) "
                                     f"need {blocks} KV blocks of {self.block_size} tokens, and the whole KV cache "
                                     f"holds {usable} ({usable * self.block_size} tokens): ask for fewer tokens, "
                                     f"or give the server a larger KV cache")
        if request.stop and self.decode is None:
            raise ValueError("stop strings need a tokenizer (the engine was built without decode)")
        if request.logprobs is not None and (not _is_int(request.logprobs) or request.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, not {request.logprobs!r}")

    def submit(self, request: Request) -> Request:
        """Queue ``request`` (checked first); it is admitted by a later ``step``. A request is submitted once."""
        if request.finished or request.output or any(request is r for r in self._in_flight()):
            raise ValueError(f"request {request.id} was submitted before: submit a new Request")
        self.check(request)
        self.waiting.append(request)
        return request

    def _in_flight(self):
        yield from self.waiting
        yield from (a.request for a in self.slots if a is not None)

    def abort(self, request: Request) -> None:
        """Stop ``request`` now (a client went away); its slot is freed."""
        self._release(request)
        if not request.finished:
            request.finish_reason = "abort"

    def fail(self, request: Request, what: str, exc: BaseException) -> None:
        """Finish ``request`` alone with finish reason "error" (``what`` failed with ``exc``); its slot is freed."""
        log.error("request %s: %s failed", request.id, what, exc_info=exc)
        self._release(request)
        if not request.finished:
            request.error = f"{what} failed: {type(exc).__name__}: {exc}"
            request.finish_reason = "error"

    def _release(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        for active in self.slots:
            if active is not None and active.request is request:
                self._free(active)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(a is not None for a in self.slots)

    def occupancy(self) -> tuple[int, int, int]:
        """(requests waiting, requests in slots, KV blocks held), for ``/metrics`` on another thread: a snapshot
        that may be a step old."""
        active = [a for a in list(self.slots) if a is not None]
        return len(self.waiting), len(active), self.decoder.pool.held()

    def run(self, requests: list[Request]) -> list[Request]:
        """Submit ``requests`` and step until every one has finished."""
        for r in requests:
            self.submit(r)
        while not all(r.finished for r in requests):
            self.step()
        return requests

    # ------------------------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self) -> list[Request]:
        """One scheduler iteration (see the module docstring); returns the requests that changed."""
        changed: list[Request] = self._admit()
        sample: list[tuple[_Active, torch.Tensor]] = []
        budget = self.prefill_chunk
        while self._prefill_order and budget > 0:
            active = self._prefill_order[0]
            self._last_chunk = 0
            try:
                logits = self._prefill_chunk(active, budget)
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the others'
                budget -= max(1, self._last_chunk)
                self.fail(active.request, "the prefill", exc)
                changed.append(active.request)
                continue
            budget -= self._last_chunk
            if active.prefilled < len(active.request.prompt):
                break
            self._prefill_order.popleft()
            if active.request.max_tokens == 0:
                active.request.finish_reason = "length"
                self._free(active)
                changed.append(active.request)
            else:
                sample.append((active, logits))
        decoding = [a for a in self.slots if a is not None and a.next_token is not None]
        if (self.speculative_ngram and len(decoding) == 1 and not sample and not self._prefill_order
                and decoding[0].request.constraint is None):
            draft = self._draft(decoding[0])
            if draft:
                changed += self._speculate(decoding[0], draft)
                decoding = []
        if decoding:
            n = max(a.slot for a in decoding) + 1
            tokens, positions, idle = [0] * n, [0] * n, [True] * n
            for a in decoding:
                r = a.request
                tokens[a.slot] = a.next_token
                positions[a.slot] = len(r.prompt) + len(r.output) - 1
                idle[a.slot] = False
                self.decoder.ensure(a.slot, positions[a.slot] + 1)
            keys = max(positions[a.slot] for a in decoding) + 1
            try:
                logits = self.decoder.step(torch.tensor(tokens, device=self.device),
                                           torch.tensor(positions, device=self.device), keys,
                                           None if not any(idle) else torch.tensor(idle, device=self.device))
            except Exception as exc:  # noqa: BLE001 - the batched forward: every request decoding in it fails
                for a in decoding:
                    self.fail(a.request, "the batched decode step", exc)
                    changed.append(a.request)
                decoding = []
            for a in decoding:
                a.next_token = None
                sample.append((a, logits[a.slot]))
        if sample:
            changed += self._sample(sample)
        self.steps += 1
        return changed

    def _admit(self) -> list[Request]:
        """Give waiting requests free slots, oldest first, while the KV pool can promise each every block it may
        need (its prompt and max_tokens, less the blocks of a cached prefix): a request that does not fit waits
        for blocks to come back, and a running request never runs out. Returns the requests whose admission failed
        (finished with an error)."""
        failed = []
        pool = self.decoder.pool
        while self.waiting and None in self.slots:
            request = self.waiting[0]
            try:
                hits, key = self._cached_prefix(request)
                fresh = self._blocks_for(request) - len(hits)
                if pool.available() - sum(pool.is_idle(b) for b in hits) - self._promised() < fresh:
                    break
                self.waiting.popleft()
                slot = self.slots.index(None)
                active = self._activate(request, slot, hits, key)
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the others'
                self.fail(request, "admitting the request", exc)
                failed.append(request)
                continue
            self.slots[slot] = active
            self._prefill_order.append(active)
        return failed

    def _blocks_for(self, request: Request) -> int:
        return -(-(len(request.prompt) + request.max_tokens) // self.block_size)

    def _promised(self) -> int:
        """Blocks admitted requests may still take."""
        held = self.decoder.slot_blocks
        return sum(max(0, a.blocks - len(held[a.slot])) for a in self.slots if a is not None)

    def _cached_prefix(self, request: Request) -> tuple[list[int], bytes]:
        """The registered blocks that hold the longest cached prefix of ``request``'s prompt (at least its last
        token is left to compute: the first output needs its logits), and the last one's key. Requests that want
        prompt log-probabilities compute the whole prompt."""
        if not self.prefix_caching or request.prompt_logprobs:
            return [], b""
        bs, pool = self.block_size, self.decoder.pool
        hits, key = [], b""
        for i in range((len(request.prompt) - 1) // bs):
            following = next_key(key, request.prompt[i * bs:(i + 1) * bs])
            block = pool.lookup(following)
            if block is None:
                break
            hits.append(block)
            key = following
        return hits, key

    def _register(self, a: _Active) -> None:
        """Register every full block of ``a`` whose tokens are all in the cache and final, for prefix caching.
        Called after a prefill chunk, and when a token is about to be taken: then every token before it (prompt
        and output, accepted drafts included) has been fed."""
        if not self.prefix_caching:
            return
        r, bs = a.request, self.block_size
        cached = a.prefilled if a.prefilled < len(r.prompt) else len(r.prompt) + len(r.output)
        if cached // bs <= a.registered:
            return
        tokens = r.prompt if cached <= len(r.prompt) else r.prompt + r.output
        blocks = self.decoder.slot_blocks[a.slot]
        for i in range(a.registered, cached // bs):
            a.last_key = next_key(a.last_key, tokens[i * bs:(i + 1) * bs])
            self.decoder.pool.register(blocks[i], a.last_key)
        a.registered = cached // bs

    def _activate(self, request: Request, slot: int, hits: list[int] | None = None, key: bytes = b"") -> _Active:
        self.decoder.reset(slot)
        hits = hits or []
        self.decoder.attach(slot, hits)
        p = request.sampling
        generator = None
        if p.temperature > 0:
            generator = torch.Generator(device=self.device)
            if p.seed is not None:
                generator.manual_seed(p.seed)
            else:
                generator.seed()
        stream = TextStream(self.decode, request.stop) if self.decode is not None else None
        active = _Active(request, slot, generator, stream, blocks=self._blocks_for(request),
                         prefilled=len(hits) * self.block_size, registered=len(hits), last_key=key)
        if self.prefix_caching and not request.prompt_logprobs:
            self.prefix_queried += len(request.prompt)
            self.prefix_hits += active.prefilled
        if p.repetition_penalty != 1.0:
            active.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            active.seen[torch.tensor(request.prompt, device=self.device)] = True
        if p.penalises_output:
            active.counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
        if request.prompt_logprobs:
            request.prompt_token_logprobs = [None]
        return active

    def _prefill_chunk(self, active: _Active, budget: int) -> torch.Tensor:
        r = active.request
        start = active.prefilled
        piece = r.prompt[start:start + budget]
        self._last_chunk = len(piece)
        ids = torch.tensor(piece, device=self.device)
        logits = self.decoder.prefill(active.slot, ids, start, all_logits=r.prompt_logprobs)
        active.prefilled += len(piece)
        self._register(active)
        if not r.prompt_logprobs:
            return logits[0]
        logits = logits[0]  # [T, V]: position i predicts prompt token start + i + 1
        targets = r.prompt[start + 1:start + len(piece) + 1]
        if targets:
            lp = torch.log_softmax(logits[:len(targets)].float(), dim=-1)
            chosen = lp.gather(-1, torch.tensor(targets, device=self.device)[:, None])[:, 0]
            k = max(1, r.logprobs or 0)
            top = lp.topk(min(k, lp.shape[-1]), dim=-1)
            for tok, c, ids_, vals in zip(targets, chosen.tolist(), top.indices.tolist(), top.values.tolist()):
                r.prompt_token_logprobs.append(TokenLogprob(tok, c, list(zip(ids_, vals))))
        return logits[-1]

    def _sample(self, rows: list[tuple[_Active, torch.Tensor]]) -> list[Request]:
        logits = torch.stack([l for _, l in rows]).float()
        actives = [a for a, _ in rows]
        changed: list[Request] = []
        if all(a.request.sampling.greedy and a.request.constraint is None for a in actives):
            tokens = logits.argmax(dim=-1)
        else:
            picked = []
            for i, a in enumerate(actives):
                p = a.request.sampling
                row = logits[i:i + 1]
                try:
                    if a.seen is not None:
                        row = apply_repetition_penalty(row, a.seen[None], p.repetition_penalty)
                    if a.counts is not None:
                        row = apply_output_penalties(row, a.counts[None], p.presence_penalty, p.frequency_penalty)
                    if a.request.constraint is not None:
                        row = a.request.constraint.mask(row)
                    picked.append(sample_next(row, p.temperature, p.top_k or None, p.top_p, a.generator))
                except Exception as exc:  # noqa: BLE001 - this request's failure, not the others'
                    self.fail(a.request, "sampling", exc)
                    changed.append(a.request)
                    picked.append(row.argmax(dim=-1))  # a placeholder: the row is dropped below
            tokens = torch.cat(picked)
        want = [i for i, a in enumerate(actives) if a.request.logprobs is not None and not a.request.finished]
        lp_rows = None
        if want:
            sel = torch.tensor(want, device=self.device)
            lp = torch.log_softmax(logits.index_select(0, sel), dim=-1)
            chosen = lp.gather(-1, tokens.index_select(0, sel)[:, None])[:, 0]
            k = max(1, max(actives[i].request.logprobs for i in want))
            top = lp.topk(min(k, lp.shape[-1]), dim=-1)
            lp_rows = dict(zip(want, zip(chosen.tolist(), top.indices.tolist(), top.values.tolist())))
        host = tokens.tolist()  # the step's read of the sampled ids
        for i, (a, token) in enumerate(zip(actives, host)):
            if a.request.finished:  # its sampling failed
                continue
            changed.append(a.request)
            try:
                self._take(a, token, None if lp_rows is None else lp_rows.get(i))
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the others'
                self.fail(a.request, "taking the sampled token", exc)
        return changed

    def _draft(self, a: _Active) -> list[int]:
        """Draft tokens for ``a`` (see ``zaya.serve.speculative.propose``), no more than its max_tokens and slot
        have room for after the token the verify step emits itself."""
        r = a.request
        room = min(r.max_tokens - len(r.output), self.capacity - len(r.prompt) - len(r.output)) - 1
        k = min(self.speculative_tokens, room)
        return propose(r.prompt + r.output, self.speculative_ngram, k) if k > 0 else []

    def _speculate(self, a: _Active, draft: list[int]) -> list[Request]:
        """Feed ``a``'s pending token and ``draft`` in one forward, take the draft tokens its sampling keeps and the
        token after them, and roll the slot's CCA state back to the last kept token."""
        r = a.request
        fed = [a.next_token] + draft
        start = len(r.prompt) + len(r.output) - 1
        try:
            snapshot = CcaSnapshot(self.decoder, a.slot)
            logits = self.decoder.prefill(a.slot, torch.tensor(fed, device=self.device), start,
                                          all_logits=True)[0].float()
            kept = self._verify(a, logits, draft)
            self.drafted += len(draft)
            self.accepted += kept
            if not r.finished and kept < len(draft):
                snapshot.restore()
                self.decoder.prefill(a.slot, torch.tensor(fed[:kept + 1], device=self.device), start)
        except Exception as exc:  # noqa: BLE001 - the request's own step
            self.fail(r, "the speculative step", exc)
        return [r]

    def _verify(self, a: _Active, logits: torch.Tensor, draft: list[int]) -> int:
        """Take tokens from ``logits`` [len(draft) + 1, V] (position i follows draft token i - 1) under ``a``'s
        sampling until one differs from the draft or the request finishes; returns how many draft tokens it kept."""
        r, p = a.request, a.request.sampling
        lp = torch.log_softmax(logits, dim=-1) if r.logprobs is not None else None
        for i in range(len(logits)):
            row = logits[i:i + 1]
            if a.seen is not None:
                row = apply_repetition_penalty(row, a.seen[None], p.repetition_penalty)
            if a.counts is not None:
                row = apply_output_penalties(row, a.counts[None], p.presence_penalty, p.frequency_penalty)
            if p.temperature < MIN_TEMPERATURE:
                token = int(row.argmax())
                kept = i < len(draft) and token == draft[i]
            elif i < len(draft):
                token, kept = verify_draft(sampling_probs(row, p.temperature, p.top_k or None, p.top_p)[0], draft[i],
                                           a.generator)
            else:
                token, kept = int(sample_next(row, p.temperature, p.top_k or None, p.top_p, a.generator)), False
            entry = None
            if lp is not None:
                top = lp[i].topk(min(max(1, r.logprobs), lp.shape[-1]))
                entry = (float(lp[i, token]), top.indices.tolist(), top.values.tolist())
            self._take(a, token, entry)
            if not kept or r.finished:
                return i + kept
        return len(draft)

    def _take(self, a: _Active, token: int, logprobs: tuple | None) -> None:
        """Apply one sampled ``token`` to ``a``'s request: eos, output, log-probabilities, stop strings, length."""
        r = a.request
        self._register(a)
        if r.constraint is not None:
            r.constraint.accept(token)
        if a.seen is not None:
            a.seen[token] = True
        if a.counts is not None:
            a.counts[token] += 1
        if r.eos_token_id is not None and not r.ignore_eos and token == r.eos_token_id:
            self._finish(a, "stop")
            return
        r.output.append(token)
        if logprobs is not None:
            c, ids_, vals = logprobs
            k = r.logprobs
            r.output_logprobs.append(TokenLogprob(token, c, list(zip(ids_[:k], vals[:k]))))
        if a.stream is not None:
            a.stream.update(r.output)
            r.text = a.stream.text[:a.stream.sent]
            if a.stream.stopped:
                self._finish(a, "stop")
                return
        if len(r.output) >= r.max_tokens or len(r.prompt) + len(r.output) >= self.capacity:
            self._finish(a, "length")
            return
        a.next_token = token

    def _finish(self, active: _Active, reason: str) -> None:
        r = active.request
        if active.stream is not None:
            active.stream.finish()
            r.text = active.stream.text
        r.finish_reason = reason
        self._free(active)

    def _free(self, active: _Active) -> None:
        if self.slots[active.slot] is active:
            self.slots[active.slot] = None
            self.decoder.release(active.slot)
        if active in self._prefill_order:
            self._prefill_order.remove(active)

    # ------------------------------------------------------------------------------------------- fixed batch
    @torch.no_grad()
    def generate_batch(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                       attention_mask: torch.Tensor | None = None,
                       eos_token_id: int | None = None) -> torch.Tensor:
        """``zaya.serve.generate.generate``: the rows of ``input_ids`` [B, T] (left-padded where ``attention_mask`` has zeros) on
        slots 0..B-1, prefilled (together when unpadded, else each row's own tokens), then decoded by the engine's
        decode step with every row at its own position, sampled together by ``decode_tokens`` (one generator for
        the batch). Host reads: one for a mask (its lengths), then only ``decode_tokens``' eos checks."""
        b, t = input_ids.shape
        if b > self.num_slots or t + max_new_tokens > self.capacity:
            raise ValueError(f"a batch of {b} x {t} + {max_new_tokens} tokens does not fit {self.num_slots} slots "
                             f"of {self.capacity}")
        dec = self.decoder
        dec.reset(0, b)
        if b * -(-(t + max_new_tokens) // self.block_size) > dec.pool.available() - self._promised():
            raise ValueError(f"a batch of {b} x {t} + {max_new_tokens} tokens does not fit the free KV blocks")
        lengths = None
        if attention_mask is not None:
            mask = attention_mask.to(device=input_ids.device, dtype=torch.bool)
            count = mask.sum(1)
            left = (mask == (torch.arange(t, device=mask.device)[None] >= t - count[:, None])).all()
            *lengths, ok = torch.cat((count, left[None].long())).tolist()  # one read
            if not ok:
                raise ValueError("attention_mask must be left padding (zeros before a row's tokens)")
            if min(lengths) == 0:
                raise ValueError("a row of attention_mask has no tokens")
            if min(lengths) == t:
                lengths = None  # no padding after all
        for i in range(b):  # every block the rows will need, now: the decode steps below allocate none
            dec.ensure(i, (t if lengths is None else lengths[i]) + max_new_tokens)
        if lengths is None:
            logits = dec.prefill(0, input_ids, 0, chunk=self.prefill_chunk)
            positions = torch.full((b,), t, device=input_ids.device)
            span = t
        else:
            logits = torch.cat([dec.prefill(i, input_ids[i, t - n:], 0, chunk=self.prefill_chunk)
                                for i, n in enumerate(lengths)])
            positions = torch.tensor(lengths, device=input_ids.device)
            span = max(lengths)
        keys = [span]

        def step(token: torch.Tensor) -> torch.Tensor:
            out = dec.step(token, positions, keys[0] + 1, aligned=lengths is None)
            positions.add_(1)
            keys[0] += 1
            return out

        return decode_tokens(input_ids, logits, step, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
