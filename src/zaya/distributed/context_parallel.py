"""Context parallelism for CCA: the ranks of a "cp" group split every sequence and attend across the split.

A sequence is cut into 2W chunks, rank r holding chunks r and 2W-1-r (zigzag: equal causal work per rank;
``zigzag_index``, ``shard``). CCA's convolutions and value shift need the tokens just before each chunk, which
live on a neighbour: the chunks' tails travel point-to-point forward and their gradients back (``_Boundary``), and
the convolutions run on [history; chunk], exact with their biases. Attention is ``allgather`` (the full K/V, one
KV head at a time) or ``ring`` (K/V blocks around the ring), with the same numbers; document masks travel as each
token's document start. The model package never imports this module: the trainer installs
``ContextParallelSequence`` through ``ZayaForCausalLM.set_sequence_seam``. The layout, the halo, the two methods
compared, the kernels and the tested precision: docs/long-context.md, "Context parallelism".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zaya.config import zigzag_length_problem
from zaya.core.device import backward_without_autocast
from zaya.model.attention import SequenceSeam, document_mask

METHODS = ("ring", "allgather")


@dataclass
class CPGroup:
    """A context-parallel group and this rank's place in it."""

    group: Any
    """The process group of the cp ranks (None: the world)."""
    rank: int
    size: int

    def global_rank(self, cp_rank: int) -> int:
        return dist.get_global_rank(self.group, cp_rank) if self.group is not None else cp_rank


# ------------------------------------------------------------------------------------------------- layout
def check_sequence_length(seq_len: int, cp_size: int, what: str = "train.seq_len") -> None:
    """Raise ValueError unless ``seq_len`` splits into 2 * cp_size chunks of at least 2 tokens each."""
    if cp_size < 1:
        raise ValueError(f"context parallel size must be >= 1, got {cp_size}")
    problem = zigzag_length_problem(seq_len, cp_size)
    if problem:
        raise ValueError(f"{what} = {seq_len} {problem}")


def zigzag_index(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[seq_len / cp_size] int64: the global indices of the tokens rank ``cp_rank`` holds (chunks r, 2W-1-r)."""
    check_sequence_length(seq_len, cp_size)
    n = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * n, (2 * cp_size - cp_rank) * n, device=device)
    return torch.cat((first, second))


def shard(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag part of ``x`` along ``dim`` (a copy)."""
    if cp_size == 1:
        return x
    index = zigzag_index(x.shape[dim], cp_size, cp_rank, x.device)
    return x.index_select(dim, index)


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's zigzag part (``parts[r]`` from rank r), along ``dim``."""
    w = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[r][0] for r in range(w)] + [halves[r][1] for r in reversed(range(w))]
    return torch.cat(ordered, dim=dim)


# ------------------------------------------------------------------------------------------------- point-to-point
def _exchange(cp: CPGroup, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
    """Post sends and receives (cp ranks) together; returns the works to wait on."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), cp.global_rank(peer), group=cp.group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, cp.global_rank(peer), group=cp.group) for t, peer in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _RingShift:
    """Send tensors to the next cp rank and receive the same shapes from the previous one, in the background."""

    def __init__(self, cp: CPGroup, tensors: list[torch.Tensor]):
        # Fresh contiguous buffers: gloo refuses strided receive buffers.
        self.received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        nxt, prev = (cp.rank + 1) % cp.size, (cp.rank - 1) % cp.size
        self.works = _exchange(cp, [(t, nxt) for t in tensors], [(t, prev) for t in self.received])

    def wait(self) -> list[torch.Tensor]:
        _wait(self.works)
        return self.received


# ------------------------------------------------------------------------------------------------- the boundary
class _Boundary(torch.autograd.Function):
    """(history of chunk r, history of chunk 2W-1-r) from this rank's (tail of its first chunk, tail of its second
    chunk), each [B, N]; who sends what to whom: docs/long-context.md, "The CCA boundary"."""

    @staticmethod
    def forward(ctx, tail_first: torch.Tensor, tail_second: torch.Tensor, cp: CPGroup):  # noqa: D102
        ctx.cp = cp
        r, w = cp.rank, cp.size
        hist_first = torch.zeros(tail_first.shape, dtype=tail_first.dtype, device=tail_first.device)
        hist_second = torch.empty(tail_second.shape, dtype=tail_second.dtype, device=tail_second.device)
        sends, recvs = [], []
        if r < w - 1:
            sends.append((tail_first, r + 1))
            recvs.append((hist_second, r + 1))
        if r > 0:
            sends.append((tail_second, r - 1))
            recvs.append((hist_first, r - 1))
        _wait(_exchange(cp, sends, recvs))
        if r == w - 1:
            hist_second.copy_(tail_first)
        return hist_first, hist_second

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_first: torch.Tensor, grad_second: torch.Tensor):  # noqa: D102
        cp: CPGroup = ctx.cp
        r, w = cp.rank, cp.size
        grad_first, grad_second = grad_first.contiguous(), grad_second.contiguous()
        tail_first = torch.zeros(grad_first.shape, dtype=grad_first.dtype, device=grad_first.device)
        tail_second = torch.zeros(grad_second.shape, dtype=grad_second.dtype, device=grad_second.device)
        sends, recvs = [], []
        if r > 0:
            sends.append((grad_first, r - 1))
            recvs.append((tail_second, r - 1))
        if r < w - 1:
            sends.append((grad_second, r + 1))
            recvs.append((tail_first, r + 1))
        _wait(_exchange(cp, sends, recvs))
        if r == w - 1:
            tail_first = tail_first + grad_second
        return tail_first, tail_second, None


# ------------------------------------------------------------------------------------------------- block kernels
def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


def _scores_mask(tq: int, tk: int, causal: bool, mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """[B or 1, 1, Tq, Tk] bool (True = may attend), or None for no mask."""
    if causal:
        tri = torch.ones(tq, tk, dtype=torch.bool, device=device).tril()[None, None]
        return tri if mask is None else mask & tri
    return mask


def _reference_block(q, k, v, causal, mask):
    """(out fp32 [B,H,Tq,D], lse fp32 [B,H,Tq]) in plain fp32 math, GQA by head expansion. Fully masked rows give
    out 0 and lse -inf."""
    groups = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.float(), _expand_heads(k, groups).float().transpose(-1, -2)) * scale
    allowed = _scores_mask(q.shape[2], k.shape[2], causal, mask, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.matmul(p, _expand_heads(v, groups).float()), lse


def _reference_block_backward(dout, q, k, v, out, lse, causal, mask):
    """(dq, dk, dv) fp32 of one block given the FINAL output and log-sum-exp of its rows."""
    groups = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    ke, ve, qf, do = _expand_heads(k, groups).float(), _expand_heads(v, groups).float(), q.float(), dout.float()
    s = torch.matmul(qf, ke.transpose(-1, -2)) * scale
    allowed = _scores_mask(q.shape[2], k.shape[2], causal, mask, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, ve.transpose(-1, -2))
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, ke)
    dk = torch.matmul(ds.transpose(-1, -2), qf)
    return dq, _sum_heads(dk, groups), _sum_heads(dv, groups)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _block(q, k, v, causal: bool, mask: torch.Tensor | None):
    """One block's (out fp32, lse fp32); rows with no visible key: out 0, lse -inf."""
    if q.device.type != "cpu":
        return _reference_block(q, k, v, causal, mask)
    groups = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expand_heads(k, groups), _expand_heads(v, groups), 0.0, causal, attn_mask=_additive(mask, q.dtype))
    out, lse = out.float(), lse.float()
    if mask is not None:  # the kernel gives a row that sees no key lse 0 and out 0
        empty = ~mask.any(dim=-1)
        if causal:
            empty = empty | ~_scores_mask(q.shape[2], k.shape[2], True, mask, q.device).any(dim=-1)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def _block_backward(dout, q, k, v, out, lse, causal: bool, mask: torch.Tensor | None):
    """One block's (dq, dk, dv) in fp32 from the final output and log-sum-exp of its query rows."""
    if q.device.type != "cpu":
        return _reference_block_backward(dout, q, k, v, out, lse, causal, mask)
    groups = q.shape[1] // k.shape[1]
    dtype = q.dtype
    # Rows that see no key of this block keep lse finite here (their probabilities are exp(-inf - lse) = 0).
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(dtype), q, _expand_heads(k, groups), _expand_heads(v, groups), out.to(dtype), lse, 0.0, causal,
        attn_mask=_additive(mask, dtype))
    return dq.float(), _sum_heads(dk.float(), groups), _sum_heads(dv.float(), groups)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                  block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's partial attention into the running (out, lse), all fp32; rows where the block saw no key
    (lse -inf) are unchanged, and a running -inf takes the block's values."""
    new_lse = torch.logaddexp(lse, block_lse)
    weight = torch.exp(block_lse - new_lse).nan_to_num(0.0)[..., None]
    out = out + weight * (block_out - out)
    return out, torch.where(torch.isneginf(new_lse), lse, new_lse)


# ------------------------------------------------------------------------------------------------- ring
def _ring_block(step: int, src: int, rank: int, n: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the zigzag ring's block at ``step`` from rank ``src``."""
    if step == 0:
        return slice(0, 2 * n), slice(0, 2 * n), True
    if src < rank:  # both local chunks come after the block's first chunk and before its second
        return slice(0, 2 * n), slice(0, n), False
    return slice(n, 2 * n), slice(0, 2 * n), False  # only the local second chunk comes after the block's chunks


def _block_mask(documents: torch.Tensor | None, block_docs: torch.Tensor | None, rows: slice,
                keys: slice) -> torch.Tensor | None:
    if documents is None:
        return None
    return document_mask(documents[:, rows], block_docs[:, keys], causal=False)


def _next_block(cp: CPGroup, step: int, kv: torch.Tensor, docs: torch.Tensor | None) -> _RingShift | None:
    """Start passing the current K/V block (and its document starts) on, unless this is the ring's last step."""
    if step == cp.size - 1:
        return None
    return _RingShift(cp, [kv] + ([docs] if docs is not None else []))


def _received(shift: _RingShift | None, kv: torch.Tensor, docs: torch.Tensor | None):
    """The block ``shift`` brought (K/V, document starts); the current one after the last step."""
    if shift is None:
        return kv, docs
    received = shift.wait()
    return received[0], (received[1] if docs is not None else None)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents, cp: CPGroup):  # noqa: D102
        w, r = cp.size, cp.rank
        n = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        docs = documents
        for step in range(w):
            shift = _next_block(cp, step, kv, docs)
            rows, keys, causal = _ring_block(step, (r - step) % w, r, n)
            o_b, lse_b = _block(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal,
                                _block_mask(documents, docs, rows, keys))
            out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
            kv, docs = _received(shift, kv, docs)
        ctx.cp = cp
        ctx.save_for_backward(q, k, v, out, lse, documents)
        return out.to(q.dtype)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, dout):  # noqa: D102
        q, k, v, out, lse, documents = ctx.saved_tensors
        cp: CPGroup = ctx.cp
        w, r = cp.size, cp.rank
        n = q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        docs = documents
        for step in range(w):
            shift = _next_block(cp, step, kv, docs)
            rows, keys, causal = _ring_block(step, (r - step) % w, r, n)
            dq_b, dk_b, dv_b = _block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, keys],
                                               kv[1][:, :, keys], out[:, :, rows], lse[:, :, rows], causal,
                                               _block_mask(documents, docs, rows, keys))
            dq[:, :, rows] += dq_b
            dkv[0][:, :, keys] += dk_b
            dkv[1][:, :, keys] += dv_b
            kv, docs = _received(shift, kv, docs)  # the next block, received while this one was computed
            # The accumulator follows its block; after the last step this hands it back to the block's owner.
            dkv = _RingShift(cp, [dkv]).wait()[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


# ------------------------------------------------------------------------------------------------- all-gather
class _PendingGather:
    """An all-gather of one rank-local tensor over the cp group, started now and waited for on first use."""

    def __init__(self, cp: CPGroup, local: torch.Tensor):
        self.local = local.detach().contiguous()  # outside autograd: _GatheredSequence is the gradient path
        self.size = cp.size
        # Concatenated along the first axis, as gloo wants it; viewed as [W, ...] on arrival.
        self.buffer = torch.empty((cp.size * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype,
                                  device=local.device)
        self.work = _all_gather(self.buffer, self.local, cp.group)

    def result(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer.view((self.size,) + tuple(self.local.shape))


def _all_gather(out: torch.Tensor, local: torch.Tensor, group: Any):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    return gather(out, local, group=group, async_op=True)


def _reduce_scatter(out: torch.Tensor, parts: torch.Tensor, group: Any) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, parts, group=group)


def _to_sequence_order(gathered: torch.Tensor, dim: int) -> torch.Tensor:
    """[W, ...] per-rank zigzag parts -> the full sequence along ``dim`` (of one part)."""
    return unshard(list(gathered.unbind(0)), dim=dim)


def _to_rank_order(full: torch.Tensor, w: int, dim: int) -> torch.Tensor:
    """The inverse of ``_to_sequence_order``: [W, ...] with rank r's chunks (r, 2W-1-r) concatenated."""
    chunks = full.chunk(2 * w, dim=dim)
    return torch.stack([torch.cat((chunks[r], chunks[2 * w - 1 - r]), dim=dim) for r in range(w)])


class _GatheredSequence(torch.autograd.Function):
    """The full-sequence [B, H, S, D] (fp32) from every rank's zigzag part; the backward reduce-scatters the
    gradient (fp32) back to the parts."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, pending: _PendingGather, cp: CPGroup):  # noqa: D102
        ctx.cp, ctx.dtype = cp, local.dtype
        return _to_sequence_order(pending.result(), dim=2).float()

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        cp: CPGroup = ctx.cp
        parts = _to_rank_order(grad.float(), cp.size, dim=2).contiguous()
        mine = torch.empty(parts.shape[1:], dtype=torch.float32, device=grad.device)
        _reduce_scatter(mine, parts.flatten(0, 1), cp.group)
        return mine.to(ctx.dtype), None, None


class _ChunkAttention(torch.autograd.Function):
    """The queries of zigzag chunk ``chunk`` (n tokens) against the gathered keys before and at it: the earlier
    chunks without a mask, its own with a causal one, merged in fp32 like the ring's blocks. Masks (documents only)
    are rebuilt from the document starts in the backward rather than kept: an [n, S] mask per chunk and layer would
    outweigh the activations it serves (flash kernels take no mask otherwise)."""

    @staticmethod
    def forward(ctx, q, k, v, chunk: int, q_docs, k_docs):  # noqa: D102
        n = q.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for keys, causal in _chunk_pieces(chunk, n):
            o_b, lse_b = _block(q, k[:, :, keys], v[:, :, keys], causal, _piece_mask(q_docs, k_docs, keys))
            out, lse = merge_partial(out, lse, o_b, lse_b)
        ctx.chunk = chunk
        ctx.save_for_backward(q, k, v, out, lse, q_docs, k_docs)
        return out.to(q.dtype)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, dout):  # noqa: D102
        q, k, v, out, lse, q_docs, k_docs = ctx.saved_tensors
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for keys, causal in _chunk_pieces(ctx.chunk, q.shape[2]):
            dq_b, dk_b, dv_b = _block_backward(dout, q, k[:, :, keys], v[:, :, keys], out, lse, causal,
                                               _piece_mask(q_docs, k_docs, keys))
            dq += dq_b
            dk[:, :, keys] += dk_b
            dv[:, :, keys] += dv_b
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _chunk_pieces(chunk: int, n: int) -> list[tuple[slice, bool]]:
    pieces = [(slice(0, chunk * n), False)] if chunk else []
    return pieces + [(slice(chunk * n, (chunk + 1) * n), True)]


def _piece_mask(q_docs: torch.Tensor | None, k_docs: torch.Tensor | None, keys: slice) -> torch.Tensor | None:
    return None if q_docs is None else document_mask(q_docs, k_docs[:, keys], causal=False)


def _allgather_attention(q, k, v, documents, cp: CPGroup) -> torch.Tensor:
    w, r = cp.size, cp.rank
    hq, hk = q.shape[1], k.shape[1]
    groups, n = hq // hk, q.shape[2] // 2
    full_docs = None
    if documents is not None:
        full_docs = _to_sequence_order(_PendingGather(cp, documents).result(), dim=1)
    kv = torch.stack((k, v), dim=2)  # [B, Hkv, 2, T, D]: one gather per KV head carries its keys and values
    pending = _PendingGather(cp, kv[:, 0])
    outs = []
    for h in range(hk):
        current = pending
        if h + 1 < hk:
            pending = _PendingGather(cp, kv[:, h + 1])  # in flight while head h is attended
        # [B, 2, S, D] in sequence order (the gathered parts' token axis is 2 once the head axis is taken).
        full = _GatheredSequence.apply(kv[:, h], current, cp)
        head_q = q[:, h * groups:(h + 1) * groups]
        parts = []
        for half, chunk in enumerate((r, 2 * w - 1 - r)):
            end = (chunk + 1) * n
            rows = slice(half * n, (half + 1) * n)
            # One cast per use: their gradients then meet at the fp32 ``full`` (summed in fp32).
            keys, values = full[:, 0:1, :end].to(q.dtype), full[:, 1:2, :end].to(q.dtype)
            q_docs = None if documents is None else documents[:, rows]
            k_docs = None if full_docs is None else full_docs[:, :end]
            parts.append(_ChunkAttention.apply(head_q[:, :, rows], keys, values, chunk, q_docs, k_docs))
        outs.append(torch.cat(parts, dim=2))
    return torch.cat(outs, dim=1)


# ------------------------------------------------------------------------------------------------- the seam
class ContextParallelSequence(SequenceSeam):
    """The sequence seam of one cp rank: its tokens are the zigzag chunks r and 2W-1-r of every sequence."""

    def __init__(self, cp: CPGroup, method: str = "allgather"):
        if method not in METHODS:
            raise ValueError(f"unknown context parallel method {method!r}; use one of {', '.join(METHODS)}")
        if cp.size < 2:
            raise ValueError("context parallelism needs a cp group of at least 2 ranks")
        self.cp, self.method = cp, method

    def global_index(self, t: int, device: torch.device) -> torch.Tensor:
        return zigzag_index(t * self.cp.size, self.cp.size, self.cp.rank, device)

    def _halves(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[dim]
        if t % 2 or t // 2 < 2:
            raise ValueError(f"a context-parallel rank holds two zigzag chunks of >= 2 tokens, got {t} tokens")
        return x.chunk(2, dim=dim)

    def boundary(self, packed, delayed, reach):
        b, c, t = packed.shape
        n = t // 2
        pq_first, pq_second = self._halves(packed, 2)
        tails = [torch.cat((p[..., n - reach:].flatten(1), d[:, -1]), dim=1)
                 for p, d in zip((pq_first, pq_second), self._halves(delayed, 1))]
        hist_first, hist_second = _Boundary.apply(tails[0], tails[1], self.cp)
        history = torch.cat([h[:, :c * reach].view(b, c, reach) for h in (hist_first, hist_second)], dim=-1)
        first = torch.stack([h[:, c * reach:] for h in (hist_first, hist_second)], dim=1)
        return history, first

    def convolve(self, conv, packed, history):
        reach = history.shape[-1] // 2
        chunks = self._halves(packed, 2)
        histories = history.split(reach, dim=-1)
        # Both chunks in one convolution call: stacked along the batch, joined in token-major memory as in
        # SequenceSeam.convolve (the convolutions run channels-last).
        stacked = torch.cat([torch.cat((h.mT, c.mT), dim=1) for h, c in zip(histories, chunks)], dim=0)
        first, second = conv(stacked.mT).chunk(2, dim=0)
        return torch.cat((first.mT, second.mT), dim=1).mT

    def shift_values(self, delayed, first):
        return torch.cat([torch.cat((first[:, i:i + 1], part[:, :-1]), dim=1)
                          for i, part in enumerate(self._halves(delayed, 1))], dim=1)

    def attend(self, q, k, v, documents):
        self._halves(q, 2)
        if self.method == "ring":
            return _RingAttention.apply(q, k, v, documents, self.cp)
        return _allgather_attention(q, k, v, documents, self.cp)
