"""zaya.optim.Muon: torch.optim.Muon's update on 2-D params, per-expert on 3-D, fast NS paths, checkpointable.

The distributed versions (DDP owner, FSDP2) are tested in tests/test_muon_dist.py.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from zaya.distributed.checks import HostReads
from zaya.optim import Muon, orthogonalize, zeropower_via_newtonschulz
from zaya.optim import newton_schulz as ns

COEFFS = (3.4445, -4.775, 2.0315)


def make_params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in shapes]


def make_grads(shapes, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def run(opt, params, grads):
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone().to(p.dtype)
        opt.step()


def ns_fp64(x, coeffs=COEFFS, steps=5):
    """The NS polynomial in float64, per matrix of a 2-D or 3-D tensor."""
    coeffs = ns.iteration_coefficients(coeffs, steps)
    X = x.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    for a, b, c in coeffs:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


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


# A wide matrix, a tall one, and two of one shape so that the batched path really stacks.
SHAPES_2D = [(12, 40), (40, 12), (16, 24), (16, 24)]


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("method", ["reference", "auto"])
def test_matches_torch_muon_bf16(adjust_lr_fn, nesterov, method):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref, ours = make_params(SHAPES_2D), make_params(SHAPES_2D)
    grads = make_grads(SHAPES_2D, steps=3)
    run(torch.optim.Muon(ref, **kw), ref, grads)
    run(Muon(ours, **kw, ns_method=method), ours, grads)
    # "reference" runs torch's operations in torch's order, one matrix at a time: bit-identical. At these sizes
    # "auto" is the standard iteration, batched by shape (baddbmm instead of addmm, same order, fp32 accumulation
    # inside each bf16 matmul): 1e-6 (a few fp32 ulps of params ~0.1-1) allows only accumulation-order noise.
    # One flipped bf16 rounding in O would move a param by ~lr_adj * 2**-8 ~ 1e-4, and any real difference in
    # the math far more, so both fail. (Measured on this CPU: 0.0, bit-identical.)
    for p, r in zip(ours, ref):
        if method == "reference":
            assert torch.equal(p, r)
        else:
            torch.testing.assert_close(p, r, rtol=0, atol=1e-6)


# Shapes that take the fast CPU paths: Gram iteration one matrix at a time (256x1024 and its transpose),
# symmetric-blocked standard iteration (512x512, 2 row blocks), and the batched Gram iteration (2 x 130x600).
FAST_SHAPES = [(256, 1024), (1024, 256), (512, 512), (130, 600), (130, 600)]


def test_fast_paths_are_the_ones_exercised():
    cfg = ns.NSConfig(ns.iteration_coefficients(COEFFS, 5), 1e-7, torch.bfloat16, "auto", (3,))
    cpu = torch.device("cpu")
    assert ns.plan(cfg, 256, 1024, cpu, batched=False) == ("gram", 1)
    assert ns.plan(cfg, 512, 512, cpu, batched=False) == ("standard", 2)
    assert ns.plan(cfg, 130, 600, cpu, batched=True) == ("gram", 1)
    assert ns.plan(cfg, 2048, 4096, cpu, batched=False) == ("gram", 8)
    assert ns.plan(cfg, 2048, 2048, cpu, batched=False) == ("standard", 8)
    assert ns.plan(cfg, 64, 2048, cpu, batched=True) == ("standard", 1)  # too small for Gram


# bf16 on a CPU without native bf16 is slow (about 20 s a case); nesterov=False changes only the momentum formula,
# which test_fp32_newton_schulz_matches_fp32_reference checks both ways in every default run.
@pytest.mark.parametrize("nesterov", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_fast_paths_match_torch_within_bf16_tolerance(nesterov):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    ref, ours = make_params(FAST_SHAPES), make_params(FAST_SHAPES)
    init = [p.detach().clone() for p in ref]
    # One step: the paths are chosen by shape, not by step; the momentum buffer over steps is checked against
    # torch's bf16 Muon by test_matches_torch_muon_bf16 (3 steps, "auto", both nesterov settings).
    grads = make_grads(FAST_SHAPES, steps=1)
    run(torch.optim.Muon(ref, **kw), ref, grads)
    opt = Muon(ours, **kw)
    run(opt, ours, grads)
    assert opt.gram_fallbacks == 0
    # Both run the same polynomial in bf16 with different rounding: torch's own bf16 result is ~1% (Frobenius)
    # off the exact one on Gaussian inputs and the Gram iteration ~2% (see test_accuracy_against_float64).
    # Measured: the updates differ by 1.5% on the Gram shapes and 0.0 on 512x512 (the 2-block symmetric products
    # give torch's bits). 6% fails one iteration fewer (measured 23-31%), a wrong restart or transpose (O(1))
    # and a wrong lr adjustment or decay (>= 10%).
    for p, r, p0 in zip(ours, ref, init):
        assert rel(p.detach() - p0, r.detach() - p0) < 0.06


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_fp32_newton_schulz_matches_fp32_reference(adjust_lr_fn, nesterov):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours = make_params(SHAPES_2D)
    grads = make_grads(SHAPES_2D, steps=3)
    expected = reference_fp32_muon(make_params(SHAPES_2D), grads, **kw)
    run(Muon(ours, **kw, ns_dtype=torch.float32), ours, grads)
    # Same fp32 operations in the same order (batching only stacks the matmuls): params are O(0.1-1) and fp32
    # eps is 1.2e-7, so 1e-6 allows a few ulps of kernel-blocking differences and nothing else.
    for p, e in zip(ours, expected):
        torch.testing.assert_close(p, e, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(256, 1024), (1024, 256), (512, 512), (3, 130, 600)])
def test_fp32_fast_paths_match_float64_polynomial(method, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    got = orthogonalize(x, COEFFS, 5, dtype=torch.float32, method=method)
    # fp32 rounding through 5 iterations: measured 1.3e-6 to 2.7e-6 (standard and Gram alike); 2e-5 is far below
    # any change of the polynomial (a coefficient off by 1e-3 gives ~1e-3).
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel(got, ns_fp64(x)) < 2e-5


def _test_matrices(m, n):
    g = torch.Generator().manual_seed(5)
    q1 = torch.linalg.qr(torch.randn(m, m, generator=g))[0]
    q2 = torch.linalg.qr(torch.randn(n, m, generator=g))[0]
    return {
        "gaussian": torch.randn(m, n, generator=g),
        "low rank + noise": torch.randn(m, 16, generator=g) @ torch.randn(16, n, generator=g)
        + 0.05 * torch.randn(m, n, generator=g),
        "singular values 1..1e-4": (q1 * torch.logspace(0, -4, m)) @ q2.T,
        "rank 1": torch.randn(m, 1, generator=g) @ torch.randn(1, n, generator=g),
    }


@pytest.mark.parametrize("kind", ["gaussian", "low rank + noise", "singular values 1..1e-4", "rank 1"])
def test_accuracy_against_float64(kind):
    # The bf16 Gram iteration against the exact polynomial, next to torch's own bf16 error. Measured, 256x1024:
    # Gaussian 0.020 vs torch 0.012; low rank + noise 0.12 vs 0.16; singular values 1..1e-4 0.076 vs 0.088;
    # rank 1 1.54 vs 1.56 (both amplify the bf16 noise in the 255 empty directions). Without its restart the
    # Gram iteration drifts to 2.4 and 1.3 on the two structured inputs.
    x = _test_matrices(256, 1024)[kind]
    exact = ns_fp64(x)
    torch_err = rel(zeropower_via_newtonschulz(x), exact)
    ours_err = rel(orthogonalize(x, method="gram"), exact)
    assert ours_err < 2.5 * torch_err + 1e-3


def test_drifting_gram_iteration_falls_back_to_standard():
    # Without restarts the Gram iteration on a rank-1 matrix blows up (largest singular value ~3000 instead of
    # ~1); the norm check catches it and the update is corrected to the standard iteration's result. The Gram
    # update was applied first and is taken back (p += lr * (O_gram - O_standard)), so the result equals the
    # standard one up to the rounding of the two fp32 additions: measured 1.9e-6 max abs (4e-6 relative), where
    # keeping the drifted update would be off by O(1) relative.
    x = _test_matrices(256, 1024)["rank 1"]
    standard = orthogonalize(x, method="standard")
    p = nn.Parameter(torch.zeros(256, 1024))
    p.grad = x.clone()
    opt = Muon([p], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, ns_method="gram", gram_restarts=())
    with HostReads() as reads:
        opt.step()
    assert reads.total == 1, reads.report()
    assert opt.gram_fallbacks == 1
    torch.testing.assert_close(-p.detach(), standard.float(), rtol=0, atol=1e-5)
    assert rel(-p.detach(), standard.float()) < 1e-4


# Shapes for the corrections, with ns_method="gram" (the Gram iteration at any size, so small is enough): stacks
# of a 3-D parameter with a same-shape 2-D one, a tall one, two 2-D ones. The one-at-a-time path's correction is
# covered by test_drifting_gram_iteration_falls_back_to_standard.
FIX_SHAPES = [(3, 12, 40), (12, 40), (40, 12), (16, 24), (16, 24)]
# Shapes "auto" sends to the Gram iteration (m >= 128, m < n after the transpose), as small as that allows.
GRAM_SHAPES = [(2, 128, 256), (128, 256), (256, 128), (130, 200)]


def _first_element_positive(out, cfg):
    """A stand-in drift check that flags some matrices of every stack and not others, the same on every run."""
    return out[..., 0, 0] > 0


def _flag_all(out, cfg):
    return torch.ones(out.shape[:-2], dtype=torch.bool, device=out.device)


def _one_step(shapes, monkeypatch=None, check=None, **kw):
    """One step from zero params with momentum 0 and no decay: each matrix ends at -O (lr 1)."""
    if check is not None:
        monkeypatch.setattr(ns, "drift_flags", check)
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, g in zip(params, make_grads(shapes, steps=1)[0]):
        p.grad = g
    opt = Muon(params, lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, **kw)
    with HostReads() as reads:
        opt.step()
    if check is not None:
        monkeypatch.undo()
    mats = [m for p in params for m in (p.detach().unbind(0) if p.ndim == 3 else [p.detach()])]
    return mats, opt, reads


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_flagged_gram_results_are_corrected_to_standard(monkeypatch, ns_dtype):
    kw = dict(ns_dtype=ns_dtype, ns_method="gram")
    gram, _, _ = _one_step(FIX_SHAPES, **kw)
    standard, _, _ = _one_step(FIX_SHAPES, ns_dtype=ns_dtype, ns_method="standard")
    # Everything flagged: every matrix ends where the standard iteration puts it. The Gram update is applied and
    # taken back in fp32, so the result is the standard one up to the rounding of two fp32 additions to entries
    # below 1 (measured: 6e-8 max abs, 4e-8 relative, in both dtypes), while the Gram and the standard results
    # differ by at least 1e-2 max abs / 2e-2 relative in bf16 and 5.7e-7 / 1.0e-6 in fp32 (measured, per
    # matrix), so the bounds below fail for any matrix left uncorrected.
    fixed, opt, reads = _one_step(FIX_SHAPES, monkeypatch, _flag_all, **kw)
    assert reads.total == 1, reads.report()
    assert opt.gram_fallbacks == len(gram) == 7
    for f, s, g in zip(fixed, standard, gram):
        torch.testing.assert_close(f, s, rtol=0, atol=2.5e-7)
        assert rel(f, s) < 3e-7
    # Some flagged, some not, within the same stacks: only the flagged matrices change, and their stack mates
    # keep their Gram results bit for bit.
    partial, opt, reads = _one_step(FIX_SHAPES, monkeypatch, _first_element_positive, **kw)
    assert reads.total == 1, reads.report()
    flagged = [bool(-g[0, 0] > 0) for g in gram]  # p = -O, and the stand-in check looks at O[0, 0]
    assert 0 < sum(flagged) < len(gram) and opt.gram_fallbacks == sum(flagged)
    for p, s, g, f in zip(partial, standard, gram, flagged):
        if f:
            torch.testing.assert_close(p, s, rtol=0, atol=2.5e-7)
        else:
            assert torch.equal(p, g)


def test_one_host_read_per_step():
    # Several Gram-path matrices, stacked (the one-at-a-time path: test_drifting_gram_iteration_falls_back_to_
    # standard): all their drift checks are read at once.
    params = make_params(GRAM_SHAPES)
    opt = Muon(params, lr=0.02)
    for p, g in zip(params, make_grads(GRAM_SHAPES, steps=1)[0]):
        p.grad = g
    with HostReads() as reads:
        opt.step()
    assert reads.total == 1, reads.report()
    assert opt.gram_fallbacks == 0
    # No Gram-path matrix (small shapes, square ones, the standard or reference method): nothing is read.
    for shapes, kw in ((SHAPES_2D + [(3, 12, 20)], {}), ([(130, 130), (2, 128, 128)], {}),
                       (GRAM_SHAPES[:3], dict(ns_method="standard")), (SHAPES_2D, dict(ns_method="reference"))):
        params = make_params(shapes)
        opt = Muon(params, lr=0.02, **kw)
        for p, g in zip(params, make_grads(shapes, steps=1)[0]):
            p.grad = g
        with HostReads() as reads:
            opt.step()
        assert reads.total == 0, (shapes, kw, reads.report())


def test_coefficient_schedules():
    x = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(4))
    constant = orthogonalize(x, COEFFS, 5, dtype=torch.float32)
    assert torch.equal(orthogonalize(x, [COEFFS] * 2, 5, dtype=torch.float32), constant)  # last triple repeats
    pe = orthogonalize(x, "polar_express", 5, dtype=torch.float32)
    assert rel(pe, ns_fp64(x, "polar_express")) < 2e-5
    assert rel(pe, constant) > 1e-2  # a different polynomial
    with pytest.raises(ValueError, match="schedule"):
        Muon([nn.Parameter(torch.zeros(2, 3))], ns_coefficients="fast")
    with pytest.raises(ValueError, match="exactly 3 values"):
        Muon([nn.Parameter(torch.zeros(2, 3))], ns_coefficients=(1.0, 2.0))


# bf16 large: 20x the fp32 time on a CPU without native bf16 (34 s on 2 busy cores); on the CPU the plan (batched or
# one at a time, Gram or standard, row blocks) does not depend on the NS dtype, so fp32 large takes the same path and
# bf16 small-batched checks a stack cast to bf16.
@pytest.mark.parametrize("ns_dtype,shapes_3d", [
    (torch.bfloat16, [(3, 12, 20), (3, 20, 12)]),
    (torch.float32, [(3, 12, 20), (3, 20, 12)]),
    pytest.param(torch.bfloat16, [(2, 256, 640), (2, 640, 256)], marks=pytest.mark.slow),
    (torch.float32, [(2, 256, 640), (2, 640, 256)]),
], ids=["small-batched-bf16", "small-batched-fp32", "large-one-at-a-time-bf16", "large-one-at-a-time-fp32"])
def test_3d_equals_per_expert_2d(ns_dtype, shapes_3d):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
    stacked = make_params(shapes_3d)
    E = shapes_3d[0][0]
    split = [nn.Parameter(p.detach()[e].clone()) for p in stacked for e in range(E)]
    grads = make_grads(shapes_3d, steps=2)
    run(Muon(stacked, **kw), stacked, grads)
    run(Muon(split, **kw), split, [[g[e] for g in gs for e in range(E)] for gs in grads])
    # Every expert matrix goes through the same code as a 2-D parameter of its shape (the same batch of
    # same-shape matrices when small, the same 2-D kernels when large), with the lr adjusted for (out, in).
    for i, p in enumerate(stacked):
        assert torch.equal(p.detach(), torch.stack([q.detach() for q in split[E * i:E * i + E]]))


def test_3d_lr_adjustment_uses_expert_shape():
    # One tall expert stack: "original" scales by sqrt(out/in) of one expert, i.e. sqrt(20/5) = 2, not by the
    # [E*out, in] or [E, out] shape. With momentum 0 and no decay the step is exactly -lr * 2 * O.
    p = make_params([(2, 20, 5)])[0]
    before = p.detach().clone()
    p.grad = torch.randn(2, 20, 5)
    Muon([p], lr=0.01, weight_decay=0.0, momentum=0.0, nesterov=False, ns_dtype=torch.float32).step()
    o = zeropower_via_newtonschulz(p.grad, dtype=torch.float32)
    torch.testing.assert_close(p.detach(), before - 0.01 * 2 * o, rtol=0, atol=1e-7)


def test_bf16_param_momentum_buffer_is_not_overwritten():
    # torch.optim.Muon (2.13) normalises the buffer of a bf16 param in place when nesterov=False (its NS does
    # buf.bfloat16().div_(...), and .bfloat16() of a bf16 tensor is the tensor itself). Ours must not.
    for shape in [(4, 6), (256, 512)]:
        p = nn.Parameter(torch.randn(shape, dtype=torch.bfloat16))
        p.grad = torch.randn(shape, dtype=torch.bfloat16)
        opt = Muon([p], momentum=0.5, nesterov=False)
        opt.step()
        assert torch.equal(opt.state[p]["momentum_buffer"], p.grad * 0.5)


# bf16: the same state and the same resume at 20x the fp32 time on a CPU without native bf16 (22 s on 2 busy cores)
@pytest.mark.parametrize("ns_dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])
def test_state_dict_roundtrip_is_bit_identical(ns_dtype):
    shapes = [(12, 40), (40, 12), (3, 8, 16), (256, 768)]  # batched and (256 rows: muon_cpu_small) one at a time
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
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


def test_state_dict_of_the_previous_version_loads():
    # Checkpoints written before ns_method / gram_restarts existed: the missing options take their defaults.
    p = make_params([(12, 40)])[0]
    opt = Muon([p], lr=0.02)
    sd = opt.state_dict()
    for key in ("ns_method", "gram_restarts"):
        del sd["param_groups"][0][key]
    opt = Muon([p], lr=0.02)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["ns_method"] == "auto" and opt.param_groups[0]["gram_restarts"] == (3,)
    p.grad = torch.randn(12, 40)
    opt.step()


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"\(7,\)"):
        Muon([nn.Parameter(torch.zeros(7))])
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 5\)"):
        Muon([nn.Parameter(torch.zeros(2, 3, 4, 5))])
    with pytest.raises(ValueError, match="Adjust learning rate function"):
        Muon([nn.Parameter(torch.zeros(2, 3))], adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([nn.Parameter(torch.zeros(2, 3))], ns_dtype=torch.float16)
    with pytest.raises(ValueError, match="ns_method"):
        Muon([nn.Parameter(torch.zeros(2, 3))], ns_method="svd")
    with pytest.raises(ValueError, match="distributed"):
        Muon([nn.Parameter(torch.zeros(2, 3))], distributed="all")
    with pytest.raises(ValueError, match="distributed"):  # the old spelling: now replica_group says it
        Muon([nn.Parameter(torch.zeros(2, 3))], distributed="owner")
    opt = Muon([nn.Parameter(torch.zeros(2, 3))])
    with pytest.raises(ValueError, match=r"\(4,\)"):  # groups added later are checked too
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))]})
    with pytest.raises(ValueError, match="ns_method"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))], "ns_method": "qr"})


def test_trainer_builds_this_muon():
    from zaya.config import ConfigError, OptimConfig
    from zaya.optim.build import ParamSplit, build_optimizers

    params = [("w", nn.Parameter(torch.zeros(4, 6)))]
    muon = build_optimizers(ParamSplit(params, [], []), OptimConfig(muon_ns_method="gram"))[0]
    assert isinstance(muon, Muon) and muon.distributed == "auto"
    assert muon.replica_group is None and muon._replicas() is None  # one process: nothing to split
    assert muon.param_groups[0]["ns_method"] == "gram"
    with pytest.raises(ConfigError, match="muon_distributed"):
        OptimConfig(muon_distributed="owner")
    with pytest.raises(ConfigError, match="muon_ns_method"):
        OptimConfig(muon_ns_method="svd")
