"""Triton kernel of the symmetric products that ``zaya.optim.newton_schulz`` chooses on a GPU.

``out = beta * c + alpha * a @ b`` for a result known to be symmetric (``X X^T``, ``b A + c A A``, and the Gram
iteration's products of two polynomials in one matrix; ``c`` symmetric too): a GEMM over square tiles that computes
only the ``T (T + 1) / 2`` tiles on and above the diagonal of the ``T x T`` and stores each off-diagonal tile twice,
in place and transposed into its mirror, with the epilogue ``beta * c + alpha * acc`` applied before the store (no
separate ``addmm`` pass). At ZAYA1's 2,048 rows (16 tiles of 128) that is 136 of 256 tiles: 53 % of cuBLAS's FLOPs
for the same product.

2-D operands, or batched 3-D ones (the grid's second axis), with any strides (``X X^T`` reads ``X`` through its
transposed view), any ``m`` (masked tile edges), bf16 or fp32 inputs with fp32 accumulation and one rounding of the
result, as cuBLAS's ``addmm``; fp32 products use TF32 only where torch's own matmul does
(``torch.backends.cuda.matmul.allow_tf32``, NVIDIA). So results equal torch's within rounding: the order of the
summation differs. Plain ``tl`` operations: the source compiles for NVIDIA and AMD and runs on CPU tensors under
``TRITON_INTERPRET=1`` (the tests). Importing this module imports triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TILE = 128
"""Rows and columns of one tile on a GPU: a product of ``m <= TILE`` rows is one tile and saves nothing. (Products
with fewer upper tiles than the GPU has multiprocessors take tiles of 64, ``_config``.)"""
DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _sym_kernel(A, B, C, OUT, m, k, alpha, beta,
                s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_ob, s_om, s_on,
                HAS_C: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    # Upper tile (ti, tj), ti <= tj, numbered column by column: pid = tj (tj + 1) / 2 + ti. The float square root
    # guesses tj; the two corrections make it exact whatever its rounding.
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tj = ((tl.sqrt(8.0 * pid + 1.0) - 1.0) * 0.5).to(tl.int32)
    tj = tl.where(tj * (tj + 1) // 2 > pid, tj - 1, tj)
    tj = tl.where((tj + 1) * (tj + 2) // 2 <= pid, tj + 1, tj)
    ti = pid - tj * (tj + 1) // 2
    rows = ti * BLOCK + tl.arange(0, BLOCK)
    cols = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < m
    a_ptr = A + batch * s_ab + rows.to(tl.int64)[:, None] * s_am + ks[None, :] * s_ak
    b_ptr = B + batch * s_bb + ks[:, None] * s_bk + cols.to(tl.int64)[None, :] * s_bn
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = k0 + ks < k
        a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptr += BLOCK_K * s_ak
        b_ptr += BLOCK_K * s_bk
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_C:
        c_ptr = C + batch * s_cb + rows.to(tl.int64)[:, None] * s_cm + cols[None, :] * s_cn
        acc = beta * tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32) + alpha * acc
    else:
        acc = alpha * acc
    val = acc.to(OUT.dtype.element_ty)
    out = OUT + batch * s_ob
    tl.store(out + rows.to(tl.int64)[:, None] * s_om + cols[None, :] * s_on, val, mask=mask)
    if ti != tj:  # the mirror tile, from the same rounded values: the result is exactly symmetric off the diagonal
        tl.store(out + cols.to(tl.int64)[:, None] * s_om + rows[None, :] * s_on, tl.trans(val),
                 mask=col_ok[:, None] & row_ok[None, :])


@functools.cache
def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel compiles for ``dtype`` on GPU ``device``: fp32 everywhere, bf16 products on NVIDIA from
    Ampere (compute capability 8.0) on and on AMD's ROCm GPUs."""
    if dtype not in DTYPES:
        return False
    return dtype != torch.bfloat16 or bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors (compute units on AMD) of ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config(dtype: torch.dtype, device: torch.device, m: int, batch: int) -> tuple[int, int, int, int]:
    """(tile, K step, warps, pipeline stages): 128 x 128 tiles, K steps of 64 bf16 or 32 fp32 values (32 KiB of
    operands a stage), 8 warps, 3 stages on NVIDIA; on AMD (64 KiB of LDS per compute unit, the epilogue's transpose
    included) half the K step and 2 stages; tiles of 64 and 4 warps where 128-row tiles would leave multiprocessors
    idle (a single 1,024-row matrix: 36 upper tiles of 128, 136 of 64). On the CPU interpreter tiles of 16, so that
    the tests' small matrices span several tiles, ragged edges and mirrors. Not tuned on a GPU yet (the suite's
    ``ns_triton`` check measures them)."""
    if device.type != "cuda":
        return 16, 32, 1, 1
    amd = bool(torch.version.hip)
    stages = 2 if amd else 3
    block_k = (64 if dtype == torch.bfloat16 else 32) // (2 if amd else 1)
    tiles = triton.cdiv(m, TILE)
    if batch * tiles * (tiles + 1) // 2 < _multiprocessors(device):
        return TILE // 2, block_k, 4, stages
    return TILE, block_k, 8, stages


def _precision(dtype: torch.dtype) -> str | None:
    """``tl.dot``'s input precision: fp32 in IEEE fp32 unless torch lets its own matmul use TF32 (NVIDIA only);
    bf16 the backend's default (the tensor cores' bf16 products, exact into fp32)."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not torch.version.hip else "ieee"


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, column) strides; batch 0 for a 2-D tensor."""
    return (t.stride(0) if t.ndim == 3 else 0), t.stride(-2), t.stride(-1)


def sym_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None,
               beta: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
    """``out = beta * c + alpha * a @ b`` (``c`` None: ``alpha * a @ b``) for a symmetric result, ``[m, m]`` or
    ``[batch, m, m]``: ``a [.., m, k]``, ``b [.., k, m]``, ``c`` as ``out``, all of ``out``'s dtype and device (bf16 or
    fp32). ``out`` must not alias ``a``, ``b`` or ``c``. Returns ``out``."""
    m, k = a.shape[-2], a.shape[-1]
    batch = out.shape[0] if out.ndim == 3 else 1
    block, block_k, warps, stages = _config(out.dtype, out.device, m, batch)
    tiles = triton.cdiv(m, block)
    cc = out if c is None else c  # a pointer the kernel never reads
    _sym_kernel[(tiles * (tiles + 1) // 2, batch)](
        a, b, cc, out, m, k, float(alpha), float(beta), *_strides(a), *_strides(b), *_strides(cc), *_strides(out),
        HAS_C=c is not None, PRECISION=_precision(out.dtype), BLOCK=block, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages)
    return out
