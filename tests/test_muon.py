"""zaya.optim.Muon: equal to torch.optim.Muon on 2-D params, per-expert on 3-D, checkpointable, FSDP2-ready."""

from __future__ import annotations

import io
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from zaya.optim import Muon

COEFFS = (3.4445, -4.775, 2.0315)


def make_params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


def make_grads(shapes, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def run(opt, params, grads):
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        opt.step()


def reference_fp32_muon(params, grads, *, lr, weight_decay, momentum, nesterov, adjust_lr_fn, eps=1e-7, steps=5):
    """torch.optim.Muon's algorithm written out with an fp32 Newton-Schulz (torch's hard-codes bfloat16)."""
    a, b, c = COEFFS
    params = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for p, buf, grad in zip(params, bufs, step_grads):
            buf.lerp_(grad, 1 - momentum)
            x = (grad.lerp(buf, momentum) if nesterov else buf).clone()
            tall = x.size(0) > x.size(1)
            if tall:
                x = x.T
            x.div_(x.norm().clamp(min=eps))
            for _ in range(steps):
                gram = x @ x.T
                x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
            if tall:
                x = x.T
            A, B = p.shape
            ratio = 0.2 * math.sqrt(max(A, B)) if adjust_lr_fn == "match_rms_adamw" else math.sqrt(max(1, A / B))
            p.mul_(1 - lr * weight_decay)
            p.add_(x, alpha=-lr * ratio)
    return params


# A wide matrix, a tall one, and two of one shape so that the stacked path really stacks.
SHAPES_2D = [(12, 40), (40, 12), (16, 24), (16, 24)]


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("stack", [False, True])
def test_matches_torch_muon_bf16(adjust_lr_fn, nesterov, stack):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref, ours = make_params(SHAPES_2D), make_params(SHAPES_2D)
    grads = make_grads(SHAPES_2D, steps=3)
    run(torch.optim.Muon(ref, **kw), ref, grads)
    run(Muon(ours, **kw, stack_same_shape=stack), ours, grads)
    # The per-matrix path runs torch's operations in torch's order (bf16 addmm on the same inputs), so it must be
    # bit-identical. The stacked path runs the batched versions (baddbmm) of the same operations in the same
    # order, with fp32 accumulation inside each bf16 matmul: 1e-6 (a few fp32 ulps of params ~0.1-1) allows only
    # accumulation-order noise. One flipped bf16 rounding in O would move a param by ~lr_adj * 2**-8 ~ 1e-4, and
    # any real difference in the math far more, so both fail. (Measured on this CPU: 0.0, bit-identical.)
    for p, r in zip(ours, ref):
        if not stack:
            assert torch.equal(p, r)
        else:
            torch.testing.assert_close(p, r, rtol=0, atol=1e-6)


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_fp32_newton_schulz_matches_fp32_reference(adjust_lr_fn, nesterov):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours = make_params(SHAPES_2D)
    grads = make_grads(SHAPES_2D, steps=3)
    expected = reference_fp32_muon(make_params(SHAPES_2D), grads, **kw)
    run(Muon(ours, **kw, ns_dtype=torch.float32), ours, grads)
    # Same fp32 operations in the same order (stacking only batches the matmuls): params are O(0.1-1) and fp32
    # eps is 1.2e-7, so 1e-6 allows a few ulps of kernel-blocking differences and nothing else.
    for p, e in zip(ours, expected):
        torch.testing.assert_close(p, e, rtol=0, atol=1e-6)


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stack", [False, True])
def test_3d_equals_per_expert_2d(ns_dtype, stack):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
    shapes_3d = [(3, 12, 20), (3, 20, 12)]  # wide and tall experts
    stacked = make_params(shapes_3d)
    split = [nn.Parameter(p.detach()[e].clone()) for p in stacked for e in range(p.shape[0])]
    grads = make_grads(shapes_3d, steps=3)
    run(Muon(stacked, **kw, stack_same_shape=stack), stacked, grads)
    run(Muon(split, **kw, stack_same_shape=False), split, [[g[e] for g in gs for e in range(g.shape[0])]
                                                           for gs in grads])
    # The 2-D path uses mm and the norm of the whole matrix, the 3-D one bmm and a per-matrix norm: the same
    # arithmetic in the same order, so as above 1e-6 admits only fp32 accumulation-order noise while a changed
    # bf16 rounding (~1e-4) or an lr adjusted with the wrong shape (>= 1e-3) fails. (Measured: 0.0.)
    for i, p in enumerate(stacked):
        want = torch.stack([q.detach() for q in split[3 * i:3 * i + 3]])
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)


def test_3d_lr_adjustment_uses_expert_shape():
    # One tall expert stack: "original" scales by sqrt(out/in) of one expert, i.e. sqrt(20/5) = 2, not by the
    # [E*out, in] or [E, out] shape. With momentum 0 and no decay the step is exactly -lr * 2 * O.
    p = make_params([(2, 20, 5)])[0]
    before = p.detach().clone()
    p.grad = torch.randn(2, 20, 5)
    Muon([p], lr=0.01, weight_decay=0.0, momentum=0.0, nesterov=False, ns_dtype=torch.float32).step()
    from zaya.optim import zeropower_via_newtonschulz
    o = zeropower_via_newtonschulz(p.grad, dtype=torch.float32)
    torch.testing.assert_close(p.detach(), before - 0.01 * 2 * o, rtol=0, atol=1e-7)


def test_bf16_param_momentum_buffer_is_not_overwritten():
    # torch.optim.Muon (2.13) normalises the buffer of a bf16 param in place when nesterov=False (its NS does
    # buf.bfloat16().div_(...), and .bfloat16() of a bf16 tensor is the tensor itself). Ours must not.
    p = nn.Parameter(torch.randn(4, 6, dtype=torch.bfloat16))
    p.grad = torch.randn(4, 6, dtype=torch.bfloat16)
    opt = Muon([p], momentum=0.5, nesterov=False)
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], p.grad * 0.5)


def test_state_dict_roundtrip_is_bit_identical():
    shapes = [(12, 40), (40, 12), (3, 8, 16)]
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    grads = make_grads(shapes, steps=4)

    straight = make_params(shapes)
    run(Muon(straight, **kw), straight, grads)

    first = make_params(shapes)
    opt = Muon(first, **kw)
    run(opt, first, grads[:2])
    blob = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "optim": opt.state_dict()}, blob)
    del opt, first
    blob.seek(0)
    saved = torch.load(blob)
    assert set(saved["optim"]["state"][0]) == {"momentum_buffer"}
    resumed = [nn.Parameter(t.clone()) for t in saved["params"]]
    opt = Muon(resumed, **kw)
    opt.load_state_dict(saved["optim"])
    run(opt, resumed, grads[2:])
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"\(7,\)"):
        Muon([nn.Parameter(torch.zeros(7))])
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 5\)"):
        Muon([nn.Parameter(torch.zeros(2, 3, 4, 5))])
    with pytest.raises(ValueError, match="Adjust learning rate function"):
        Muon([nn.Parameter(torch.zeros(2, 3))], adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([nn.Parameter(torch.zeros(2, 3))], ns_dtype=torch.float16)
    opt = Muon([nn.Parameter(torch.zeros(2, 3))])
    with pytest.raises(ValueError, match=r"\(4,\)"):  # groups added later are checked too
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))]})


# ----------------------------------------------------------------------------------------------------------------
# FSDP2: 2 gloo ranks vs one process.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 7, bias=False)  # weight [7, 6]: shards of 4 and 3 rows
        self.experts = nn.Parameter(torch.randn(3, 7, 5) * 0.3)  # [E=3, out, in]: shards of 2 and 1 experts

    def forward(self, x):  # x [B, 6]
        h = torch.tanh(self.proj(x))  # [B, 7]
        return torch.einsum("bo,eoi->bei", h, self.experts).square().mean()


DIST_KW = dict(lr=0.05, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")


def train(model, steps=2):
    opt = Muon(model.parameters(), **DIST_KW)
    data = torch.randn(steps, 4, 6, generator=torch.Generator().manual_seed(123))
    for x in data:
        opt.zero_grad()
        model(x).backward()
        opt.step()
    return opt


def _fsdp_worker(rank: int, world: int, port: int, result) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks share the cores; the model is tiny
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Shard

        torch.manual_seed(0)
        model = Tiny()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = train(model)
        for name, p in model.named_parameters():
            buf = opt.state[p]["momentum_buffer"]
            assert isinstance(p, DTensor) and isinstance(buf, DTensor), name
            assert p.placements == (Shard(0),) and buf.placements == p.placements, name
            assert buf.to_local().shape == p.to_local().shape, name
        result[rank] = {name: p.detach().full_tensor().clone() for name, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_ranks_match_single_process():
    world = 2
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_fsdp_worker, args=(world, free_port(), result), nprocs=world, join=True)
        got = [dict(result[r]) for r in range(world)]
    torch.manual_seed(0)
    model = Tiny()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model)
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), init[name])  # it trained
        assert torch.equal(got[0][name], got[1][name])  # every rank holds the same full params
        # Both ranks see the same data, so the reduce-scattered mean gradient is (g + g) / 2 = g exactly, the
        # gathered update is the single-process one and NS runs on identical input: the result should be
        # bit-identical (measured: it is). 1e-6 (a few fp32 ulps) only leaves room for reduction-order noise in the
        # sharded forward/backward; applying a wrong or misaligned shard moves params by ~lr_adj ~ 1e-2.
        torch.testing.assert_close(got[0][name], p.detach(), rtol=0, atol=1e-6)
