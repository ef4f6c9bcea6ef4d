"""Triton kernels of the fused residual scaling + RMSNorm that ``zaya.model.fused_norm`` chooses on a GPU.

One pass over the rows each way. Forward: ``y = (branch + bb) * bs + (residual + rb) * rs``, stored as the new
residual stream (``res``, in the residual dtype), then ``h = weight * (res_n * rsqrt(mean(res_n^2) + eps))`` with
``res_n`` the residual cast to the norm's dtype, and the per-row rsqrt kept for the backward. Backward: recompute
``y`` from the saved inputs, the norm's input gradient from ``dh``, add ``dres``, and write the branch and residual
gradients; the five vector gradients are summed per program in fp32 and reduced over programs by torch. The same
kernels, specialised by two constexpr flags, run the residual scaling alone (``ResidualFunction``) and the norm alone
(``NormFunction``), for the joins and norms that a block boundary keeps apart.

Arithmetic is fp32 throughout; the casts the torch path makes explicitly (the residual dtype, the norm's input and
its normalised value in the weight's dtype) are made here at the same points, so fp32 results agree with it to fp32
rounding and bf16 ones to one rounding of the stored value. Plain ``tl`` operations only (no CUDA intrinsics): the
same source compiles for NVIDIA and AMD, and runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
Importing this module imports triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from zaya.core.device import backward_without_autocast
from zaya.core.kernels import guarded
from zaya.model.layers import _rms_norm

MAX_COLS = 8192
"""The widest row the kernels take (one row is held in registers); wider rows take the torch path."""
_PARTS = 5  # vector gradients summed per program: bb, bs, rb, rs, weight


@triton.jit
def _forward_kernel(A, X, BB, BS, RB, RS, W, RES, H, RSTD, n_rows, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    if HAS_RESIDUAL:
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        bb = tl.load(BB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        bs = tl.load(BS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        rb = tl.load(RB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        rs = tl.load(RS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        src = ((a + bb) * bs + (x + rb) * rs).to(RES.dtype.element_ty)
        tl.store(RES + offs, src, mask=mask)
    else:
        src = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_NORM:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        xn = src.to(W.dtype.element_ty).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xn * xn, axis=1) / n_cols + eps)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        normed = (xn * rstd[:, None]).to(W.dtype.element_ty).to(tl.float32)
        tl.store(H + offs, (w * normed).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(A, X, BB, BS, RB, RS, W, RSTD, DRES, DH, DA, DX, PART, n_rows, n_cols,
                     HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    if HAS_RESIDUAL:
        bb = tl.load(BB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        bs = tl.load(BS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        rb = tl.load(RB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        rs = tl.load(RS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_NORM:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc_bb = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_bs = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_rb = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_rs = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(pid * BLOCK_M, n_rows, tl.num_programs(0) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        if HAS_RESIDUAL:
            sa = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32) + bb
            sx = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + rb
            src = (sa * bs + sx * rs).to(DRES.dtype.element_ty)
        else:
            src = tl.load(X + offs, mask=mask, other=0.0)
        if HAS_NORM:
            xn = src.to(W.dtype.element_ty).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
            dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
            acc_w += tl.sum(dh * (xn * rstd).to(W.dtype.element_ty).to(tl.float32), axis=0)
            # d(xn * rstd)/dxn with rstd = (mean(xn^2) + eps)^-1/2:  (g - xn * rstd^2 * mean(g * xn)) * rstd
            g = (dh * w).to(W.dtype.element_ty).to(tl.float32)
            dot = tl.sum(g * xn, axis=1)[:, None] / n_cols
            dxn = ((g - xn * (rstd * rstd) * dot) * rstd).to(W.dtype.element_ty)
        if HAS_RESIDUAL:
            dy = tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_NORM:
                dy = (dy + dxn.to(tl.float32)).to(DRES.dtype.element_ty).to(tl.float32)
            tl.store(DA + offs, (dy * bs).to(DA.dtype.element_ty), mask=mask)
            tl.store(DX + offs, (dy * rs).to(DX.dtype.element_ty), mask=mask)
            acc_bb += tl.sum(dy * bs, axis=0)
            acc_bs += tl.sum(dy * sa, axis=0)
            acc_rb += tl.sum(dy * rs, axis=0)
            acc_rs += tl.sum(dy * sx, axis=0)
        else:
            tl.store(DX + offs, dxn.to(DX.dtype.element_ty), mask=mask)
    part = PART + pid.to(tl.int64) * 5 * n_cols + cols
    tl.store(part, acc_bb, mask=col_ok)
    tl.store(part + n_cols, acc_bs, mask=col_ok)
    tl.store(part + 2 * n_cols, acc_rb, mask=col_ok)
    tl.store(part + 3 * n_cols, acc_rs, mask=col_ok)
    tl.store(part + 4 * n_cols, acc_w, mask=col_ok)


def _blocks(n_cols: int) -> tuple[int, int, int]:
    """(rows per tile, padded width, warps): a tile of about 2,048 elements (one row of ZAYA1's 2,048), 4 to 16
    warps as the row widens (16 is the most an AMD GPU's 64-lane wavefronts allow in one program)."""
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, min(16, 2048 // block_n))
    warps = 4 if block_n <= 1024 else (8 if block_n <= 4096 else 16)
    return block_m, block_n, warps


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs of the backward, each looping over its share of the rows: two per multiprocessor (compute unit on
    AMD) on a GPU; two on the CPU interpreter, so that the tests run the loop over several tiles."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _forward(branch, residual, vectors, weight, eps, residual_dtype) -> tuple:
    """(res or None, h or None, rstd or None, a, x): the forward kernel on rows of the last dimension; ``branch`` and
    ``vectors`` None for the norm alone (``residual`` is then its input), ``weight`` None for the residual alone."""
    n_cols = residual.shape[-1]
    x = residual.reshape(-1, n_cols).contiguous()
    a = x if branch is None else branch.reshape(-1, n_cols).contiguous()
    n_rows, dev = x.shape[0], x.device
    res = None if branch is None else torch.empty(x.shape, dtype=residual_dtype, device=dev)
    h = None if weight is None else torch.empty(x.shape, dtype=weight.dtype, device=dev)
    rstd = None if weight is None else torch.empty(n_rows, dtype=torch.float32, device=dev)
    vectors = vectors or (x,) * 4  # pointers the kernel never reads
    block_m, block_n, warps = _blocks(n_cols)
    _forward_kernel[(triton.cdiv(n_rows, block_m),)](
        a, x, *vectors, x if weight is None else weight, res if res is not None else x, h if h is not None else x,
        rstd if rstd is not None else x, n_rows, n_cols, eps, HAS_RESIDUAL=branch is not None,
        HAS_NORM=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return res, h, rstd, a, x


def _backward(a, x, vectors, weight, rstd, grad_res, grad_h) -> tuple:
    """(d_branch or None, d_residual, [the vectors' and the weight's gradients, None where absent]): the backward
    kernel; ``vectors`` None for the norm alone, ``weight`` None for the residual alone."""
    n_rows, n_cols = x.shape
    has_residual, has_norm = vectors is not None, weight is not None
    dres = grad_res.reshape(n_rows, n_cols).contiguous() if has_residual else x
    dh = grad_h.reshape(n_rows, n_cols).contiguous() if has_norm else x
    da = torch.empty_like(a) if has_residual else None
    dx = torch.empty_like(x)
    block_m, block_n, warps = _blocks(n_cols)
    programs = max(1, min(_programs(x.device), triton.cdiv(n_rows, block_m)))
    part = torch.empty(programs, _PARTS, n_cols, dtype=torch.float32, device=x.device)
    _backward_kernel[(programs,)](
        a, x, *(vectors or (x,) * 4), x if weight is None else weight, x if rstd is None else rstd, dres, dh,
        x if da is None else da, dx, part, n_rows, n_cols, HAS_RESIDUAL=has_residual, HAS_NORM=has_norm,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    sums = part.sum(0).unbind(0)
    grads = [s.to(p.dtype) if p is not None else None
             for s, p in zip(sums, (*(vectors or (None,) * 4), weight))]
    return da, dx, grads


def _torch_grads(inputs: tuple, compute, grads: tuple) -> tuple:
    """The inputs' gradients by the torch path: ``compute(*inputs)`` again under autograd, differentiated against
    ``grads`` (None where an output has none). The fallback of a backward kernel that failed."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    with torch.enable_grad():
        outs = compute(*leaves)
    used = [(o, g) for o, g in zip(outs, grads) if g is not None]
    return torch.autograd.grad([o for o, _ in used], leaves, [g for _, g in used], allow_unused=True)


def _scaled(a, x, bb, bs, rb, rs, residual_dtype):
    """The torch path's residual scaling (``zaya.model.layers.ResidualScale``) cast to ``residual_dtype``."""
    return ((a + bb) * bs + (x + rb) * rs).to(residual_dtype)


def _flat(backward: tuple) -> tuple:
    """``_backward``'s (d_branch, d_residual, [five vector gradients]) as one tuple of seven."""
    da, dx, grads = backward
    return (da, dx, *grads)


class ResidualNormFunction(torch.autograd.Function):
    """``(res, h)`` = (residual scaling cast to ``residual_dtype``, RMSNorm of ``res`` in the weight's dtype),
    forward and backward by the kernels above. Saves the two inputs and the per-row rsqrt, as the torch path's
    functions do."""

    @staticmethod
    def forward(ctx, branch, residual, branch_bias, branch_scale, residual_bias, residual_scale, weight, eps,
                residual_dtype):  # noqa: D102
        vectors = (branch_bias, branch_scale, residual_bias, residual_scale)
        res, h, rstd, a, x = _forward(branch, residual, vectors, weight, eps, residual_dtype)
        ctx.save_for_backward(a, x, *vectors, weight, rstd)
        ctx.shapes, ctx.eps, ctx.residual_dtype = (branch.shape, residual.shape), eps, residual_dtype
        return res.view(branch.shape), h.view(branch.shape)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_res, grad_h):  # noqa: D102
        a, x, *vectors, weight, rstd = ctx.saved_tensors

        def torch_path(a, x, bb, bs, rb, rs, weight):
            res = _scaled(a, x, bb, bs, rb, rs, ctx.residual_dtype)
            return res, _rms_norm(res.to(weight.dtype), weight, ctx.eps)[0]

        da, dx, *grads = guarded(
            "fused_residual_norm", lambda: _flat(_backward(a, x, vectors, weight, rstd, grad_res, grad_h)),
            lambda: _torch_grads((a, x, *vectors, weight), torch_path,
                                 (grad_res.reshape(x.shape), grad_h.reshape(x.shape))))
        return da.view(ctx.shapes[0]), dx.view(ctx.shapes[1]), *grads, None, None


class ResidualFunction(torch.autograd.Function):
    """The residual scaling alone, cast to ``residual_dtype`` (the MoE output's join)."""

    @staticmethod
    def forward(ctx, branch, residual, branch_bias, branch_scale, residual_bias, residual_scale,
                residual_dtype):  # noqa: D102
        vectors = (branch_bias, branch_scale, residual_bias, residual_scale)
        res, _, _, a, x = _forward(branch, residual, vectors, None, 0.0, residual_dtype)
        ctx.save_for_backward(a, x, *vectors)
        ctx.shapes, ctx.residual_dtype = (branch.shape, residual.shape), residual_dtype
        return res.view(branch.shape)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_res):  # noqa: D102
        a, x, *vectors = ctx.saved_tensors
        da, dx, *grads = guarded(
            "fused_residual_norm", lambda: _flat(_backward(a, x, vectors, None, None, grad_res, None))[:6],
            lambda: _torch_grads((a, x, *vectors), lambda *t: (_scaled(*t, ctx.residual_dtype),),
                                 (grad_res.reshape(x.shape),)))
        return da.view(ctx.shapes[0]), dx.view(ctx.shapes[1]), *grads, None


class NormFunction(torch.autograd.Function):
    """RMSNorm alone (a block's attention norm, the final norm): ``x`` in the weight's dtype, as RMSNorm gets it."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # noqa: D102
        _, h, rstd, _, x2 = _forward(None, x, None, weight, eps, None)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.eps = x.shape, eps
        return h.view(x.shape)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_h):  # noqa: D102
        x, weight, rstd = ctx.saved_tensors
        dx, dw = guarded(
            "fused_residual_norm", lambda: _flat(_backward(x, x, None, weight, rstd, None, grad_h))[1::5],
            lambda: _torch_grads((x, weight), lambda x, w: (_rms_norm(x, w, ctx.eps)[0],), (grad_h.reshape(x.shape),)))
        return dx.view(ctx.shape), dw, None
