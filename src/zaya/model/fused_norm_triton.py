"""Triton kernels of the fused residual scaling + RMSNorm that ``zaya.model.fused_norm`` chooses on a GPU.

One pass over the rows each way. Forward: ``y = (branch + bb) * bs + (residual + rb) * rs``, stored as the new
residual stream (``res``, in the residual dtype), then ``h = weight * (res_n * rsqrt(mean(res_n^2) + eps))`` with
``res_n`` the residual cast to the norm's dtype, and the per-row rsqrt kept for the backward. Backward: recompute
``y`` from the saved inputs, the norm's input gradient from ``dh``, add ``dres``, and write the branch and residual
gradients; the five vector gradients are summed per program in fp32 and reduced over programs by torch.

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

MAX_COLS = 8192
"""The widest row the kernels take (one row is held in registers); wider rows take the torch path."""
_PARTS = 5  # vector gradients summed per program: bb, bs, rb, rs, weight


@triton.jit
def _forward_kernel(A, X, BB, BS, RB, RS, W, RES, H, RSTD, n_rows, n_cols, eps,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    bb = tl.load(BB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    bs = tl.load(BS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    rb = tl.load(RB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    rs = tl.load(RS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]

    res = ((a + bb) * bs + (x + rb) * rs).to(RES.dtype.element_ty)
    tl.store(RES + offs, res, mask=mask)
    xn = res.to(W.dtype.element_ty).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xn * xn, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    normed = (xn * rstd[:, None]).to(W.dtype.element_ty).to(tl.float32)
    tl.store(H + offs, (w * normed).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(A, X, BB, BS, RB, RS, W, RSTD, DRES, DH, DA, DX, PART, n_rows, n_cols,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    bb = tl.load(BB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    bs = tl.load(BS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    rb = tl.load(RB + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    rs = tl.load(RS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
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
        sa = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32) + bb
        sx = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + rb
        xn = (sa * bs + sx * rs).to(DRES.dtype.element_ty).to(W.dtype.element_ty).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        acc_w += tl.sum(dh * (xn * rstd).to(W.dtype.element_ty).to(tl.float32), axis=0)
        # d(xn * rstd)/dxn with rstd = (mean(xn^2) + eps)^-1/2:  (g - xn * rstd^2 * mean(g * xn)) * rstd
        g = (dh * w).to(W.dtype.element_ty).to(tl.float32)
        dot = tl.sum(g * xn, axis=1)[:, None] / n_cols
        dxn = ((g - xn * (rstd * rstd) * dot) * rstd).to(W.dtype.element_ty).to(tl.float32)
        dy = (tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32) + dxn).to(DRES.dtype.element_ty)
        dy = dy.to(tl.float32)
        tl.store(DA + offs, (dy * bs).to(DA.dtype.element_ty), mask=mask)
        tl.store(DX + offs, (dy * rs).to(DX.dtype.element_ty), mask=mask)
        acc_bb += tl.sum(dy * bs, axis=0)
        acc_bs += tl.sum(dy * sa, axis=0)
        acc_rb += tl.sum(dy * rs, axis=0)
        acc_rs += tl.sum(dy * sx, axis=0)
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


class ResidualNormFunction(torch.autograd.Function):
    """``(res, h)`` = (residual scaling cast to ``residual_dtype``, RMSNorm of ``res`` in the weight's dtype),
    forward and backward by the kernels above. Saves the two inputs and the per-row rsqrt, as the torch path's
    functions do."""

    @staticmethod
    def forward(ctx, branch, residual, branch_bias, branch_scale, residual_bias, residual_scale, weight, eps,
                residual_dtype):  # noqa: D102
        shape, n_cols = branch.shape, branch.shape[-1]
        a, x = branch.reshape(-1, n_cols).contiguous(), residual.reshape(-1, n_cols).contiguous()
        n_rows = a.shape[0]
        res = torch.empty(a.shape, dtype=residual_dtype, device=a.device)
        h = torch.empty(a.shape, dtype=weight.dtype, device=a.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=a.device)
        block_m, block_n, warps = _blocks(n_cols)
        _forward_kernel[(triton.cdiv(n_rows, block_m),)](
            a, x, branch_bias, branch_scale, residual_bias, residual_scale, weight, res, h, rstd, n_rows, n_cols,
            eps, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(a, x, branch_bias, branch_scale, residual_bias, residual_scale, weight, rstd)
        ctx.shapes = shape, residual.shape
        return res.view(shape), h.view(shape)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_res, grad_h):  # noqa: D102
        a, x, bb, bs, rb, rs, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = a.shape
        dres = grad_res.reshape(n_rows, n_cols).contiguous()
        dh = grad_h.reshape(n_rows, n_cols).contiguous()
        da, dx = torch.empty_like(a), torch.empty_like(x)
        block_m, block_n, warps = _blocks(n_cols)
        programs = max(1, min(_programs(a.device), triton.cdiv(n_rows, block_m)))
        part = torch.empty(programs, _PARTS, n_cols, dtype=torch.float32, device=a.device)
        _backward_kernel[(programs,)](a, x, bb, bs, rb, rs, weight, rstd, dres, dh, da, dx, part, n_rows, n_cols,
                                      BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        sums = part.sum(0)
        grads = [s.to(p.dtype) for s, p in zip(sums.unbind(0), (bb, bs, rb, rs, weight))]
        return (da.view(ctx.shapes[0]), dx.view(ctx.shapes[1]), *grads, None, None)
