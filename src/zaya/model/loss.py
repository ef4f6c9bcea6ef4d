"""Next-token cross-entropy computed in fp32 over row chunks of the logits, whatever their dtype.

``cross_entropy(logits, labels)`` equals ``F.cross_entropy(logits.float(), labels, ignore_index=-100)`` (mean over
the positions whose label is not ignored; NaN when every label is ignored) and its gradient equals autograd's
through that expression (computed in fp32 and rounded once to the logits' dtype), up to fp32 summation order.
What it saves under bf16 autocast, where the logits [N, V] are bf16: the fp32 copy of the logits, the fp32
log-softmax, the zero-filled [N, V] gradient of the NLL and the fp32 [N, V] gradient that is then cast back, all
fresh allocations as large as the logits in fp32. Instead each chunk of rows is upcast into a reused fp32 buffer (a
couple of MB, cache-resident); the forward takes its log-softmax (into a second reused buffer) and keeps only the
targets' entries, the backward recomputes its softmax and turns it into ``(softmax - onehot) * g / n``, written
straight into the gradient in the logits' dtype.

The chunk holds the device's hardware profile's ``loss_chunk_elements`` fp32 values (``zaya.core.hardware``;
by default 2^19 = 2 MB on a CPU, about the L2 of the development CPU, and 2^28 = 1 GiB on a GPU, where a small
chunk would make the loop launch-bound), read once per forward and once per backward.

``fused_cross_entropy`` is the same loss as one expression, for ``torch.compile`` (``train.compile`` compiles it
with the blocks): inductor's kernels do what the chunks do by hand, and with no Python loop. The forward reduces
each row of the logits (in their own dtype) to its max and log-sum-exp without an fp32 copy, the backward is one
pass over the logits that writes ``(softmax - onehot) * g / n`` in their dtype, and all the backward keeps is the
logits, the labels and two fp32 values per row (tests/test_compile.py counts the graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from zaya.core.device import backward_without_autocast
from zaya.core.hardware import load_profile

IGNORE_INDEX = -100
CHUNK_ELEMENTS: int | None = None  # fp32 elements per row chunk if set (tests); None: the hardware profile's
MIN_CHUNK_ROWS = 16


def chunk_rows(vocab: int, elements: int) -> int:
    """Rows of a ``vocab``-wide chunk of ``elements`` fp32 values (at least ``MIN_CHUNK_ROWS``)."""
    return max(MIN_CHUNK_ROWS, elements // max(vocab, 1))


def _chunk_rows(vocab: int, device: torch.device) -> int:
    return chunk_rows(vocab, CHUNK_ELEMENTS or load_profile(device).loss_chunk_elements)


def _chunks(n: int, vocab: int, device: torch.device):
    """Row ranges and two reused fp32 [rows, vocab] buffers."""
    rows = min(_chunk_rows(vocab, device), n)
    bufs = [torch.empty(rows, vocab, dtype=torch.float32, device=device) for _ in range(2)]
    return [(s, min(s + rows, n)) for s in range(0, n, rows)], bufs


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # noqa: D102
        n, v = logits.shape
        valid = labels != IGNORE_INDEX
        safe = labels.masked_fill(~valid, 0)
        nll = torch.empty(n, dtype=torch.float32, device=logits.device)
        ranges, (x, logp) = _chunks(n, v, logits.device)
        for s, e in ranges:
            xs, ls = x[: e - s], logp[: e - s]
            xs.copy_(logits[s:e])
            torch.log_softmax(xs, dim=-1, out=ls)
            nll[s:e] = ls.gather(1, safe[s:e, None]).squeeze(1).neg_()
        count = valid.sum()
        ctx.save_for_backward(logits, safe, valid, count)
        return (nll * valid).sum() / count

    @staticmethod
    @once_differentiable
    @backward_without_autocast
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        logits, safe, valid, count = ctx.saved_tensors
        n, v = logits.shape
        # Per-row factor g / n for counted rows, 0 for ignored ones (every row, when none is counted).
        scale = valid.float() * (grad.float() / count.clamp(min=1))
        out = torch.empty_like(logits)
        ranges, (x, p) = _chunks(n, v, logits.device)
        for s, e in ranges:
            xs, ps = x[: e - s], p[: e - s]
            xs.copy_(logits[s:e])
            torch.softmax(xs, dim=-1, out=ps)
            t = safe[s:e, None]
            ps.scatter_(1, t, ps.gather(1, t) - 1.0)
            ps.mul_(scale[s:e, None])
            out[s:e].copy_(ps)
        return out, None


def fused_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``cross_entropy`` as one expression, for a compiler to fuse (eager, it would allocate the fp32 [N, V] copies
    the chunks avoid)."""
    logits = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits.float(), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [..., V] against ``labels`` [...] (-100 = ignore), computed in fp32."""
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    if not torch.is_floating_point(logits) or logits.numel() == 0:
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
    return _ChunkedCrossEntropy.apply(logits, labels)
