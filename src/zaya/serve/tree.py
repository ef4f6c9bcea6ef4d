"""Tree-attention decoding: the KV cache of a prompt sharded over the ranks, the partial results merged per layer.

Decoding one token attends one query to every cached key; for a long prompt that read of the cache dominates a
step, and one device's memory bounds the prompt. Tree attention (arXiv 2408.04093) spreads the cache instead: the
prompt is cut into contiguous slices, one per rank, the larger ones last (``slice_bounds``); the prefill runs each
slice with a ``SequenceSeam`` per layer (``_PrefillSeam``) that gathers the CCA boundary and every slice's keys;
each decode step runs the whole model on every rank, attends the query to the local keys, and merges the ranks'
(output, log-sum-exp) partials by one of ``METHODS`` (``tree``: two all-reduces, the default; ``butterfly``,
``ring``, ``ring-partials``), in an order that gives every rank the same bits. The sampled token is broadcast
from the last rank. The layout, the merges and their communication costs: docs/long-context.md,
"Tree-attention decoding".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zaya.distributed.runtime import Runtime
from zaya.model.attention import AttentionCache, SequenceSeam
from zaya.model.zaya import DecodeState, ZayaForCausalLM
from zaya.serve.sampling import check_sampling, decode_tokens

METHODS = ("tree", "butterfly", "ring", "ring-partials")
EMPTY_LSE = -torch.finfo(torch.float32).max
"""The log-sum-exp of a rank without keys: finite, so that exp(lse - m) is 0 instead of a NaN from inf - inf."""


def slice_bounds(length: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s contiguous slice of ``length`` prompt positions; the remainder goes to the
    last ranks, so the last rank holds the prompt's end whenever the prompt has a token."""
    base, extra = divmod(length, world)
    first_long = world - extra
    start = rank * base + max(0, rank - first_long)
    return start, start + base + (1 if rank >= first_long else 0)


@dataclass
class CommStats:
    """Communication of the decode steps on this rank (prefill not counted)."""

    collectives: int = 0
    """Collective calls and send/recv rounds waited on, one after another."""
    steps: int = 0
    """Latency steps: an all-reduce or broadcast over p ranks counts ceil(log2 p) (a tree, as NCCL's tree algorithm
    and recursive doubling run small messages), a send/recv round 1."""
    bytes_sent: int = 0
    """Bytes this rank handed to the backend: a send's tensor, an all-reduce's or broadcast's tensor once."""
    tokens: int = 0

    def reset(self) -> None:
        self.collectives = self.steps = self.bytes_sent = self.tokens = 0

    def add(self, collectives: int, steps: int, sent: int = 0) -> None:
        self.collectives += collectives
        self.steps += steps
        self.bytes_sent += sent


def _check_device(tensor: torch.Tensor, device: torch.device, what: str) -> None:
    if tensor.device != device:
        raise RuntimeError(f"tree decoding {what}: the tensor is on {tensor.device}, the process group's "
                           f"collectives on {device} (build it with device=runtime.device)")


def _all_gather(runtime: Runtime, local: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``local`` (same shape and dtype on every rank), in rank order."""
    _check_device(local, runtime.device, "all_gather")
    if not runtime.distributed:
        return [local]
    # gloo wants contiguous receive buffers of exactly the sent shape: allocate them fresh, not empty_like a view.
    parts = [torch.empty(local.shape, dtype=local.dtype, device=runtime.device) for _ in range(runtime.world_size)]
    dist.all_gather(parts, local.contiguous())
    return parts


# ---------------------------------------------------------------------------------------------- local attention
def local_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` [B, Hq, T, D] over ``keys``/``values`` [B, Hkv, S, D] (GQA: query head h uses KV
    head h // (Hq / Hkv), as SDPA's ``enable_gqa``), in fp32, with no mask: (o [B, Hq, T, D], lse [B, Hq, T]).

    Written out instead of a fused kernel because it must return the log-sum-exp on every device; for one query
    token the [B, Hq, 1, S] scores are small next to the cache it reads."""
    with torch.autocast(q.device.type, enabled=False):  # fp32 on every rank, under bf16 autocast too
        return _local_attention(q, keys, values)


def _local_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, t, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    if s == 0:
        return (torch.zeros(b, hq, t, d, dtype=torch.float32, device=q.device),
                torch.full((b, hq, t), EMPTY_LSE, dtype=torch.float32, device=q.device))
    group = hq // hkv
    qg = q.float().reshape(b, hkv, group * t, d)
    scores = torch.matmul(qg, keys.float().transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [B, Hkv, G*T, S]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    o = torch.matmul(torch.exp(scores - lse), values.float())
    return o.reshape(b, hq, t, d), lse.reshape(b, hq, t)


def pack(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """One partial result as one fp32 tensor [.., D + 1] (the lse as the last channel): one message."""
    return torch.cat((o, lse[..., None]), dim=-1).contiguous()


def merge_pieces(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two packed partials (``pack``) merged into the partial over both sets of keys, fp32:

        m = max(lse_a, lse_b),  w = exp(lse - m),  o = (w_a o_a + w_b o_b) / (w_a + w_b),  lse = m + log(w_a + w_b)

    Stable (every weight <= 1, one of them 1) and safe for empty partials (lse = -finfo.max gets weight 0 next to a
    real one; two empty ones stay empty), in either argument: unlike the running sigmoid/logsigmoid update, whose
    running lse must be a real one. Not bitwise symmetric: callers merge in one order on every rank."""
    lse_a, lse_b = a[..., -1:], b[..., -1:]
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    return torch.cat(((a[..., :-1] * w_a + b[..., :-1] * w_b) / total, m + torch.log(total)), dim=-1)


def _merge_in_rank_order(pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    ranks = sorted(pieces)
    out = pieces[ranks[0]]
    for r in ranks[1:]:
        out = merge_pieces(out, pieces[r])
    return out


def _wait(works) -> None:
    for work in works or ():
        work.wait()


class ShardedKeys:
    """One rank's part of every layer's KV cache during decoding (the ``KeyShard`` of ``AttentionCache.shard``).

    ``held_by_rank``: the prompt keys of every rank's slice, in rank order (this rank's is ``held``); new tokens'
    keys are stored on the last rank. ``method``: one of ``METHODS`` (docs/long-context.md)."""

    def __init__(self, runtime: Runtime, held_by_rank: list[int], method: str, stats: CommStats):
        if len(held_by_rank) != runtime.world_size:
            raise ValueError(f"ShardedKeys: {len(held_by_rank)} slice lengths for a world of {runtime.world_size}")
        self.runtime, self.method, self.stats = runtime, method, stats
        self.held_by_rank = list(held_by_rank)
        self.held = self.held_by_rank[runtime.rank]
        self.appends = runtime.rank == runtime.world_size - 1
        self._log_p = math.ceil(math.log2(runtime.world_size)) if runtime.world_size > 1 else 0
        # gloo runs an all-reduce of a few hundred bytes as a ring of 2 (p - 1) rounds: beyond 2 ranks the tree's
        # all-reduces go by recursive doubling there instead (log2 p rounds; at 2 ranks both are one exchange and
        # measured the same). NCCL's own are latency-optimal already.
        self._doubling_all_reduce = (runtime.distributed and runtime.world_size > 2
                                     and dist.get_backend() == "gloo")

    def attend(self, q, k, v, cache: AttentionCache, cache_start: int) -> torch.Tensor:
        if q.shape[2] != 1:
            raise ValueError(f"a sharded decode cache takes one token per step, got {q.shape[2]} (prefill goes "
                             "through ShardedDecoder.prefill)")
        # the model's state counts this rank's slice and every token fed so far: the same count on every rank
        new_tokens = cache_start - self.held + 1
        end = self.held
        if self.appends:
            end = cache_start + 1
            cache.keys[:, :, cache_start:end] = k.to(cache.keys.dtype)
            cache.values[:, :, cache_start:end] = v.to(cache.values.dtype)
        keys, values = cache.keys[:, :, :end], cache.values[:, :, :end]
        with torch.autocast(q.device.type, enabled=False):  # the merge stays in fp32 (the collectives' dtype)
            if self.method == "ring":
                out = self._ring_attention(q, keys, values, new_tokens)
            else:
                out = self.merge(*local_attention(q, keys, values))
        return out.to(q.dtype)

    def merge(self, o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Every rank's attention output from the local (o [B, Hq, T, D], lse [B, Hq, T]), fp32 (the merging
        methods; ``ring`` moves the keys instead and goes through ``attend``)."""
        if not self.runtime.distributed:
            return o
        with torch.autocast(o.device.type, enabled=False):
            if self.method == "tree":
                return self._tree(o, lse)
            if self.method == "butterfly":
                return self._butterfly(pack(o, lse))[..., :-1]
            if self.method == "ring-partials":
                return self._ring_partials(pack(o, lse))[..., :-1]
        raise ValueError(f"ShardedKeys.merge: method {self.method!r} does not merge partials (use attend)")

    def _tree(self, o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        m = self._all_reduce(lse.clone(), "max")  # a copy: the backend's all-reduce works in place
        weight = torch.exp(lse - m)[..., None]
        fused = self._all_reduce(torch.cat((o * weight, weight), dim=-1), "sum")
        if self._doubling_all_reduce:
            rounds, sends = self._doubling_rounds()
            self.stats.add(2, 2 * rounds, sends * (m.nbytes + fused.nbytes))
        else:
            self.stats.add(2, 2 * self._log_p, m.nbytes + fused.nbytes)
        return fused[..., :-1] / fused[..., -1:]

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """One of the tree's all-reduces (``op`` "max" or "sum"): the backend's own, or on gloo by recursive
        doubling (a max or a sum of two operands rounds the same whichever comes first, so every rank still
        gets the same bits)."""
        if not self._doubling_all_reduce:
            return self.runtime.all_reduce(tensor, op)
        return self._recursive_doubling(tensor, torch.maximum if op == "max" else torch.add)

    def _exchange(self, piece: torch.Tensor, peer: int) -> torch.Tensor:
        """Send ``piece`` to ``peer`` and receive its piece of the same shape (one round)."""
        incoming = torch.empty(piece.shape, dtype=piece.dtype, device=self.runtime.device)
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, piece, peer), dist.P2POp(dist.irecv, incoming, peer)]))
        return incoming

    def _butterfly(self, piece: torch.Tensor) -> torch.Tensor:
        rounds, sends = self._doubling_rounds()
        self.stats.add(rounds, rounds, sends * piece.nbytes)
        return self._recursive_doubling(piece, merge_pieces)

    def _doubling_rounds(self) -> tuple[int, int]:
        """(send/recv rounds, messages this rank sends) of one ``_recursive_doubling``."""
        world, rank = self.runtime.world_size, self.runtime.rank
        q = 1 << (world.bit_length() - 1)
        rounds = q.bit_length() - 1 + (2 if q < world else 0)
        return rounds, 1 if rank >= q else q.bit_length() - 1 + (1 if rank + q < world else 0)

    def _recursive_doubling(self, piece: torch.Tensor, combine) -> torch.Tensor:
        """``combine`` over every rank's ``piece``, the result on every rank. Over the largest power of 2 q <= p
        ranks: in round k rank r exchanges its block's combined piece with rank r xor 2^k and both compute
        ``combine(lower block's, upper block's)``, so that after log2 q rounds every rank holds the same bits.
        Ranks q..p-1 first hand their piece to rank r - q and get the result back from it at the end."""
        _check_device(piece, self.runtime.device, "recursive-doubling exchange")
        world, rank = self.runtime.world_size, self.runtime.rank
        q = 1 << (world.bit_length() - 1)
        if rank >= q:
            dist.send(piece, rank - q)
            result = torch.empty(piece.shape, dtype=piece.dtype, device=self.runtime.device)
            dist.recv(result, rank - q)
            return result
        if rank + q < world:
            extra = torch.empty(piece.shape, dtype=piece.dtype, device=self.runtime.device)
            dist.recv(extra, rank + q)
            piece = combine(piece, extra)
        distance = 1
        while distance < q:
            peer = rank ^ distance
            other = self._exchange(piece, peer)
            piece = combine(piece, other) if rank < peer else combine(other, piece)
            distance <<= 1
        if rank + q < world:
            dist.send(piece, rank + q)
        return piece

    def _ring_partials(self, piece: torch.Tensor) -> torch.Tensor:
        """Pass the partials around the ring (p - 1 rounds: send what arrived last to r + 1, receive from r - 1),
        then merge them in rank order."""
        _check_device(piece, self.runtime.device, "ring exchange")
        world, rank = self.runtime.world_size, self.runtime.rank
        pieces = {rank: piece}
        for step in range(1, world):
            incoming = torch.empty(piece.shape, dtype=piece.dtype, device=self.runtime.device)
            _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, pieces[(rank - step + 1) % world], (rank + 1) % world),
                                          dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]))
            pieces[(rank - step) % world] = incoming
        self.stats.add(world - 1, world - 1, (world - 1) * piece.nbytes)
        return _merge_in_rank_order(pieces)

    def _ring_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        new_tokens: int) -> torch.Tensor:
        """Ring attention: the KV shards travel around the ring (rank r sends the shard it holds to r + 1 and
        receives the next from r - 1, posted before it attends the current one); the partials are merged in rank
        order. Shard lengths are known everywhere (the slices, plus ``new_tokens`` on the last rank), so each
        receive buffer is exact; empty shards are not sent."""
        world, rank = self.runtime.world_size, self.runtime.rank
        if world == 1:
            return local_attention(q, keys, values)[0]
        _check_device(keys, self.runtime.device, "ring attention")
        lengths = list(self.held_by_rank)
        lengths[-1] += new_tokens
        b, hkv, _, d = keys.shape
        visiting = (keys.contiguous(), values.contiguous())
        partials: dict[int, torch.Tensor] = {}
        sent = 0
        for step in range(world):
            owner = (rank - step) % world
            works, incoming = None, None
            if step < world - 1:
                arriving = lengths[(rank - step - 1) % world]
                incoming = tuple(torch.empty(b, hkv, arriving, d, dtype=keys.dtype, device=keys.device)
                                 for _ in range(2))
                ops = []
                if lengths[owner]:
                    ops += [dist.P2POp(dist.isend, t, (rank + 1) % world) for t in visiting]
                    sent += visiting[0].nbytes + visiting[1].nbytes
                if arriving:
                    ops += [dist.P2POp(dist.irecv, t, (rank - 1) % world) for t in incoming]
                works = dist.batch_isend_irecv(ops) if ops else None
            partials[owner] = pack(*local_attention(q, *visiting))
            if incoming is not None:
                _wait(works)
                visiting = incoming
        self.stats.add(world - 1, world - 1, sent)
        return _merge_in_rank_order(partials)[..., :-1]


# ---------------------------------------------------------------------------------------------- prefill
@dataclass
class _Layout:
    """Every rank's slice of the prompt (all ranks compute it from the prompt length alone)."""

    length: int
    world: int
    rank: int

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        return slice_bounds(self.length, self.world, self.rank if rank is None else rank)

    @property
    def widest(self) -> int:
        """The longest slice: what every rank pads its part of a gather to."""
        return -(-self.length // self.world)

    def owner(self, position: int) -> int:
        return next(r for r in range(self.world) if self.bounds(r)[0] <= position < self.bounds(r)[1])


def _tail_width(att) -> int:
    return att.conv_depthwise.in_channels * att.conv_reach + att.v_previous_proj.out_features


class _PrefillSeam(SequenceSeam):
    """One layer's seam while rank r runs the model on its slice of the prompt; it also fills the layer's cache
    (this slice's keys and values, and the CCA state at the slice's end)."""

    def __init__(self, runtime: Runtime, layout: _Layout, cache: AttentionCache):
        self.runtime, self.layout, self.cache = runtime, layout, cache

    def global_index(self, t: int, device: torch.device) -> torch.Tensor:
        start, end = self.layout.bounds()
        return torch.arange(start, end, device=device)

    def boundary(self, packed, delayed, reach):
        """The ``reach`` raw rows and the delayed value before this slice, taken from the gathered tails of every
        slice (the row before a slice may sit on any earlier rank when slices are shorter than ``reach``)."""
        b, c, t = packed.shape
        dtype = self.cache.conv_state.dtype
        rows = torch.zeros(b, c, reach, dtype=dtype, device=packed.device)
        kept = min(t, reach)
        rows[..., reach - kept:] = packed[..., t - kept:]
        tails = _all_gather(self.runtime, torch.cat((rows.flatten(1), delayed[:, -1].to(dtype)), dim=1))
        start, _ = self.layout.bounds()
        history = packed.new_zeros(b, c, reach)
        for j, position in enumerate(range(start - reach, start)):
            if position >= 0:
                owner = self.layout.owner(position)
                row = reach - (self.layout.bounds(owner)[1] - position)  # its index among the owner's tail rows
                history[..., j] = tails[owner][:, :c * reach].view(b, c, reach)[..., row]
        first = delayed.new_zeros(b, 1, delayed.shape[-1])
        if start > 0:
            first[:, 0] = tails[self.layout.owner(start - 1)][:, c * reach:]
        self.cache.conv_state = torch.cat((history, packed), dim=-1)[..., -reach:].to(dtype)
        self.cache.value_state = delayed[:, -1].to(dtype)
        return history, first

    def attend(self, q, k, v, documents):
        """The slice's queries over the keys of every slice up to its own, causal in global positions."""
        if documents is not None:
            raise ValueError("tree decoding's prefill has no document masks (one prompt is one document)")
        b, hkv, t, d = k.shape
        cache, layout = self.cache, self.layout
        cache.keys[:, :, :t] = k.to(cache.keys.dtype)
        cache.values[:, :, :t] = v.to(cache.values.dtype)
        padded = torch.zeros(b, hkv, layout.widest, 2 * d, dtype=cache.keys.dtype, device=k.device)
        padded[:, :, :t] = torch.cat((cache.keys[:, :, :t], cache.values[:, :, :t]), dim=-1)
        parts = _all_gather(self.runtime, padded)
        start, end = layout.bounds()
        seen = torch.cat([parts[r][:, :, :layout.bounds(r)[1] - layout.bounds(r)[0]] for r in range(layout.rank + 1)],
                         dim=2).to(q.dtype)
        keys, values = seen.split(d, dim=-1)
        positions = torch.arange(end, device=q.device)
        mask = positions[None, :] <= positions[start:end, None]  # [T, end]: a query sees keys up to its own position
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != hkv)


def _join_prefill(model: ZayaForCausalLM, runtime: Runtime, layout: _Layout, batch: int, dtype: torch.dtype) -> None:
    """A rank without prompt tokens: take part in each layer's gathers (the boundary's for CCA, then the keys'), in
    the order the other ranks' forwards issue them, with nothing of its own to contribute."""
    for block in model.blocks:
        att = block.attention
        if att.kind == "cca":
            _all_gather(runtime, torch.zeros(batch, _tail_width(att), dtype=dtype, device=runtime.device))
        _all_gather(runtime, torch.zeros(batch, att.num_kv_heads, layout.widest, 2 * att.head_dim, dtype=dtype,
                                         device=runtime.device))


# ---------------------------------------------------------------------------------------------- the decoder
class ShardedDecoder:
    """Decoding with the KV cache sharded over the runtime's ranks; every rank calls every method, in step.

    ``prefill(input_ids, max_new_tokens)`` returns the next-token logits after the prompt, ``step(token)`` those after
    one more token per row (the same on every rank); ``stats`` counts the decode steps' communication."""

    def __init__(self, model: ZayaForCausalLM, runtime: Runtime, method: str = "tree"):
        if method not in METHODS:
            raise ValueError(f"decode method {method!r}: use one of {', '.join(METHODS)}")
        device = next(model.parameters()).device
        if device != runtime.device:
            raise ValueError(f"the model is on {device}, the runtime on {runtime.device}: load it with "
                             "device=runtime.device")
        self.model, self.runtime, self.method = model, runtime, method
        self.stats = CommStats()
        self.state: DecodeState | None = None
        self._fed = 0
        self._positions: torch.Tensor | None = None

    @property
    def last(self) -> int:
        return self.runtime.world_size - 1

    def allocate(self, batch: int, prompt_length: int, max_new_tokens: int, dtype: torch.dtype | None = None) -> None:
        """This rank's decode state for a prompt of ``prompt_length`` tokens and ``max_new_tokens`` more: its slice's
        KV buffers (the last rank's with room for the new tokens), each layer's cache shard. ``prefill`` calls it; a
        benchmark may call it and fill the buffers itself."""
        if prompt_length < 1:
            raise ValueError("tree decoding needs a prompt of at least one token")
        runtime, model = self.runtime, self.model
        held_by_rank = [end - start for start, end in (slice_bounds(prompt_length, runtime.world_size, r)
                                                       for r in range(runtime.world_size))]
        held = held_by_rank[runtime.rank]
        dtype = dtype or model.embed.weight.dtype
        capacity = held + (max_new_tokens if runtime.rank == self.last else 0)
        shard = ShardedKeys(runtime, held_by_rank, self.method, self.stats)
        caches = [blk.attention.new_cache(batch, capacity, dtype, runtime.device) for blk in model.blocks]
        for cache in caches:
            cache.shard = shard
        # key_valid spans the positions the model's state counts (the prompt slice and every new token), so that its
        # capacity check passes on every rank; only the last rank stores the new tokens' keys.
        self.state = DecodeState(caches=caches, key_valid=torch.ones(batch, held + max_new_tokens, dtype=torch.bool,
                                                                     device=runtime.device), length=held)
        self._fed = 0
        self._positions = torch.arange(prompt_length, prompt_length + max_new_tokens, device=runtime.device)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Run the prompt [B, L] (the same on every rank), each rank its slice; the next-token logits [B, V]."""
        runtime, model = self.runtime, self.model
        _check_device(input_ids, runtime.device, "prefill")
        b, length = input_ids.shape
        self.allocate(b, length, max_new_tokens)
        layout = _Layout(length, runtime.world_size, runtime.rank)
        start, end = layout.bounds()
        caches = self.state.caches
        dtype = caches[0].keys.dtype
        logits = None
        if end > start:
            seams = [_PrefillSeam(runtime, layout, cache) for cache in caches]
            previous = [blk.attention.seam for blk in model.blocks]
            try:
                for blk, seam in zip(model.blocks, seams):
                    blk.attention.seam = seam
                logits = model(input_ids[:, start:end], logits_to_keep=1).logits[:, -1]
            finally:
                for blk, seam in zip(model.blocks, previous):
                    blk.attention.seam = seam
        else:
            _join_prefill(model, runtime, layout, b, dtype)
        return self._share_prefill(logits, b)

    def _share_prefill(self, logits: torch.Tensor | None, batch: int) -> torch.Tensor:
        """Broadcast the last rank's logits and per-layer CCA state (conv rows, delayed value) in one fp32 tensor."""
        caches = self.state.caches
        pieces = [(c.conv_state, c.value_state) for c in caches if c.conv_state is not None]
        shapes = [t.shape for pair in pieces for t in pair]
        vocab = self.model.config.vocab_size
        width = vocab + sum(math.prod(s[1:]) for s in shapes)
        if self.runtime.rank == self.last:
            flat = [logits.float()] + [t.float().reshape(batch, -1) for pair in pieces for t in pair]
            buffer = torch.cat(flat, dim=1)
        else:
            buffer = torch.empty(batch, width, dtype=torch.float32, device=self.runtime.device)
        self.runtime.broadcast(buffer, src=self.last)
        parts = buffer.split([vocab] + [math.prod(s[1:]) for s in shapes], dim=1)
        state_parts = iter(parts[1:])
        for cache in caches:
            if cache.conv_state is not None:
                dtype = cache.keys.dtype
                cache.conv_state = next(state_parts).reshape(cache.conv_state.shape).to(dtype).clone()
                cache.value_state = next(state_parts).reshape(cache.value_state.shape).to(dtype).clone()
        return parts[0].clone()

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed ``token`` [B] (the same on every rank) at the next position; the next-token logits [B, V]."""
        if self.state is None:
            raise ValueError("ShardedDecoder.step before prefill (or allocate)")
        if self._fed >= self._positions.shape[0]:
            raise ValueError(f"the decode state was allocated for {self._positions.shape[0]} new tokens; pass a "
                             "larger max_new_tokens to prefill")
        position = self._positions[self._fed:self._fed + 1]
        self._fed += 1
        self.stats.tokens += 1
        return self.model(token[:, None], position_ids=position, state=self.state).logits[:, -1]

    def share(self, token: torch.Tensor) -> torch.Tensor:
        """The last rank's sampled token, on every rank (one broadcast a token)."""
        if not self.runtime.distributed:
            return token
        token = token.contiguous()
        self.stats.add(1, math.ceil(math.log2(self.runtime.world_size)), token.nbytes)
        return self.runtime.broadcast(token, src=self.last)


@torch.no_grad()
def tree_generate(model: ZayaForCausalLM, runtime: Runtime, input_ids: torch.Tensor, max_new_tokens: int,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int | None = None, eos_token_id: int | None = None, method: str = "tree",
                  stats: CommStats | None = None) -> torch.Tensor:
    """``model.generate`` with the prompt's KV cache sharded over the runtime's ranks (every rank calls it with the
    same arguments and gets the same tokens). ``input_ids`` [B, T] without padding, on the runtime's device; returns
    [B, T + max_new_tokens]. ``stats``, if given, receives the decode steps' communication counts."""
    check_sampling(max_new_tokens, temperature, top_p)
    if max_new_tokens == 0:
        return input_ids
    model.check_input_ids(input_ids)
    decoder = ShardedDecoder(model, runtime, method)
    if stats is not None:
        decoder.stats = stats
    logits = decoder.prefill(input_ids, max_new_tokens)
    return decode_tokens(input_ids, logits, decoder.step, max_new_tokens, temperature, top_k, top_p, seed,
                         eos_token_id, share=decoder.share)
