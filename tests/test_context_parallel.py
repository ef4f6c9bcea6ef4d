"""Context parallelism (zaya.distributed.context_parallel): the zigzag layout, the CCA boundary exchange and both
attention methods against single-process attention, on 2-4 gloo ranks.

Tolerances: fp32 1e-5 (the blocks' partial results are merged in fp32; the difference to one-pass attention is
summation order, seen at about 1e-6). bf16 inputs: outputs 2e-2 and gradients 5e-2 absolute on O(1) values: the
reference itself runs in bf16 (SDPA), one bf16 rounding of O(1) values is 4e-3, and the methods round the block
outputs / cast gradients once more."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import run_ok
from model_helpers import tiny_config

from zaya.distributed import context_parallel as cpm
from zaya.model.attention import document_mask


# --------------------------------------------------------------------------------------------- layout (1 process)
def test_zigzag_layout_balances_causal_work_and_round_trips():
    seq, w = 32, 4
    parts = [cpm.zigzag_index(seq, w, r) for r in range(w)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq))
    assert parts[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    # causal work (keys visible) is the same on every rank
    assert len({int((p + 1).sum()) for p in parts}) == 1
    x = torch.randn(3, seq, 5)
    assert torch.equal(cpm.unshard([cpm.shard(x, w, r) for r in range(w)]), x)


@pytest.mark.parametrize("seq_len,cp", [(30, 2), (12, 4), (4, 2)])
def test_sequence_lengths_that_do_not_split_are_refused_with_the_fix(seq_len, cp):
    with pytest.raises(ValueError, match=rf"train.seq_len = {seq_len}.*multiple of 2 x {cp}"):
        cpm.check_sequence_length(seq_len, cp)


def test_merge_of_partial_results_equals_one_softmax():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8)
    full = F.scaled_dot_product_attention(q, k, v)
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    for keys in (slice(0, 4), slice(4, 5), slice(5, 12)):
        o, l = cpm._block(q, k[:, :, keys], v[:, :, keys], False, None)
        out, lse = cpm.merge_partial(out, lse, o, l)
    assert torch.allclose(out, full, atol=1e-6)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-5)


def test_cpu_kernel_and_reference_block_agree_with_masks_and_empty_rows():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    mask = torch.rand(2, 1, 6, 8) > 0.5
    mask[:, :, 0] = False  # a row that sees no key of this block
    o1, l1 = cpm._block(q, k, v, False, mask)
    o2, l2 = cpm._reference_block(q, k, v, False, mask)
    assert torch.equal(torch.isneginf(l1), torch.isneginf(l2)) and bool(torch.isneginf(l1[:, :, 0]).all())
    assert torch.allclose(o1, o2, atol=1e-6)
    dout = torch.randn(o1.shape)
    lse = l2.masked_fill(torch.isneginf(l2), 0.0)
    for a, b in zip(cpm._block_backward(dout, q, k, v, o1, lse, False, mask),
                    cpm._reference_block_backward(dout, q, k, v, o2, lse, False, mask)):
        assert torch.allclose(a, b, atol=1e-5)


# --------------------------------------------------------------------------------------------- attention (ranks)
def _documents(batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """[B, S] document starts of random packed documents (position restarts)."""
    docs = torch.zeros(batch, seq, dtype=torch.int64)
    for b in range(batch):
        starts = sorted(set(torch.randint(1, seq, (3,), generator=generator).tolist()))
        for s in starts:
            docs[b, s:] = s
    return docs


def _reference(q, k, v, documents):
    """Single-process causal attention (document mask optional), SDPA with autograd."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents, documents, True),
                                             enable_gqa=True)
    return out, q, k, v


def _attention_parity(rank: int, world: int, seq: int) -> dict:
    from zaya.distributed.runtime import start

    rt = start(cp_size=world)
    cp = cpm.CPGroup(rt.cp_group, rt.cp_rank, rt.cp_size)
    g = torch.Generator().manual_seed(0)
    b, hq, hk, d = 2, 4, 2, 16
    q, k, v, dout = (torch.randn(b, h, seq, d, generator=g) for h in (hq, hk, hk, hq))
    docs = _documents(b, seq, g)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        for with_docs in (False, True):
            documents = docs if with_docs else None
            ref, rq, rk, rv = _reference(q.to(dtype), k.to(dtype), v.to(dtype), documents)
            ref.backward(dout.to(dtype))
            for method in cpm.METHODS:
                seam = cpm.ContextParallelSequence(cp, method)
                lq, lk, lv = (cpm.shard(t.to(dtype), world, rank, dim=2).requires_grad_() for t in (q, k, v))
                local_docs = None if documents is None else cpm.shard(documents, world, rank, dim=1)
                out = seam.attend(lq, lk, lv, local_docs)
                out.backward(cpm.shard(dout.to(dtype), world, rank, dim=2))
                pairs = [(out, ref), (lq.grad, rq.grad), (lk.grad, rk.grad), (lv.grad, rv.grad)]
                errors[(str(dtype), with_docs, method)] = [
                    float((a.detach().float() - cpm.shard(r.float(), world, rank, dim=2)).abs().max()) for a, r in pairs]
    return errors


# 4 ranks on 2 cores is the slowest; 2 (even) and 3 (odd) ranks cover the split and the exchange.
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_attention_equals_single_process_attention(world):
    seq = 4 * 2 * world  # four tokens per chunk
    for rank, errors in enumerate(run_ok(_attention_parity, world, seq)):
        for (dtype, with_docs, method), errs in errors.items():
            out_tol, grad_tol = (1e-5, 1e-5) if "float32" in dtype else (2e-2, 5e-2)
            assert errs[0] <= out_tol, (rank, dtype, with_docs, method, errs)
            assert max(errs[1:]) <= grad_tol, (rank, dtype, with_docs, method, errs)


# --------------------------------------------------------------------------------------------- CCA layer (ranks)
def _cca_layer_parity(rank: int, world: int, seq: int, method: str) -> dict:
    from zaya.distributed.runtime import start
    from zaya.model.attention import Attention
    from zaya.model.layers import RotaryEmbedding

    rt = start(cp_size=world)
    cp = cpm.CPGroup(rt.cp_group, rt.cp_rank, rt.cp_size)
    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=32, head_dim=8, vocab_size=64)
    layer = Attention(cfg)
    layer.reset_parameters(0.2, 0.2)
    with torch.no_grad():  # biases that matter: a zero-padded halo would differ from the true one
        layer.conv_depthwise.bias.normal_()
        layer.conv_grouped.bias.normal_()
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
    x = torch.randn(2, seq, cfg.hidden_size)
    dout = torch.randn(2, seq, cfg.hidden_size)
    positions = torch.arange(seq)

    full_x = x.clone().requires_grad_()
    cos, sin = rope.cos_sin(positions[None])
    layer(full_x, cos, sin).backward(dout)
    ref_out = layer(x, cos, sin).detach()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    layer.seam = cpm.ContextParallelSequence(cp, method)
    local_x = cpm.shard(x, world, rank).requires_grad_()
    cos, sin = rope.cos_sin(layer.seam.global_index(local_x.shape[1], x.device)[None])
    out = layer(local_x, cos, sin)
    out.backward(cpm.shard(dout, world, rank))
    grads = {n: rt.all_reduce(p.grad.clone(), over="cp") for n, p in layer.named_parameters()}
    return {"out": float((out - cpm.shard(ref_out, world, rank)).abs().max()),
            "x_grad": float((local_x.grad - cpm.shard(full_x.grad, world, rank)).abs().max()),
            "param_grads": max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads)}


@pytest.mark.parametrize("world,method", [(2, "ring"), (3, "allgather"),
                                          pytest.param(4, "ring", marks=pytest.mark.slow)])  # ring: at 2 too
def test_cca_layer_with_the_halo_exchange_equals_the_full_sequence_layer(world, method):
    """Forward and backward of a whole CCA layer: the boundary convolution (with its biases) and the value shift
    across chunk and rank borders, including rank W-1 whose second chunk follows its own first one."""
    for rank, errors in enumerate(run_ok(_cca_layer_parity, world, 2 * world * 3, method)):
        assert max(errors.values()) <= 1e-5, (rank, errors)
