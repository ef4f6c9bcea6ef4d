"""Muon: momentum + Newton-Schulz orthogonalised updates for matrix parameters; fast, expert-aware, distributed.

The constructor and the update rule are those of :class:`torch.optim.Muon` (torch 2.13, ``torch/optim/_muon.py``).
On top of torch's version this one has:

* stacked 3-D parameters ``[E, out, in]`` (MoE experts): every expert matrix is orthogonalised on its own and the
  learning-rate adjustment uses the per-expert shape ``(out, in)``;
* a faster Newton-Schulz (NS) that does fewer FLOPs for the same polynomial (``ns_method``, see "Speed" below);
* ``ns_dtype`` (``torch.bfloat16`` like torch, or ``torch.float32``) and a choice of coefficient schedule
  (``ns_coefficients``: one ``(a, b, c)`` for every iteration as in torch, one triple per iteration, or the name
  ``"polar_express"``);
* distributed work splitting (``distributed``): each matrix is orthogonalised by one rank only (see "Distributed").

Update, per parameter ``p`` with gradient ``g`` and momentum buffer ``B`` (zeros at the first step)::

    B   <- lerp(B, g, 1 - momentum)          = momentum * B + (1 - momentum) * g
    U   <- lerp(g, B, momentum) if nesterov  = (1 - momentum) * g + momentum * B
           B                    otherwise
    O   <- NS(U)                             (per matrix: X / max(||X||_F, eps), then ns_steps quintic iterations
                                              X <- a X + (b A + c A^2) X with A = X X^T, on the transpose if tall)
    p   <- p * (1 - lr * weight_decay)       (decoupled weight decay, with the *unadjusted* lr)
    p   <- p - adjust(lr, (out, in)) * O

Momentum form: this is torch's EMA ("lerp") form, ``B = momentum * B + (1 - momentum) * g``, not the
heavy-ball ``B = momentum * B + g`` its docstring shows; the Nesterov look-ahead is ``g.lerp(B, momentum)``.
We keep it because the result is meant to equal ``torch.optim.Muon`` (so settings and checkpoints carry over), and
because the EMA form is the one in Keller Jordan's reference implementation. The overall scale of ``U`` does
not matter anyway: NS normalises it by its Frobenius norm, so the two forms differ only in how the current
gradient is weighted against the history. NS never writes to the momentum buffer (torch 2.13 does, for a bf16
parameter with ``nesterov=False``, because ``buf.bfloat16()`` is ``buf`` itself).

Weight decay is decoupled (AdamW style): ``p *= 1 - lr * weight_decay`` before the update, using the group's
``lr`` before the shape adjustment, exactly as torch does. It is not added to the gradient and does not enter the
momentum buffer.

``adjust_lr_fn``: ``None``/``"original"`` scales lr by ``sqrt(max(1, out / in))`` (Keller Jordan);
``"match_rms_adamw"`` by ``0.2 * sqrt(max(out, in))`` (Moonshot, "Muon is Scalable for LLM Training").

Speed (``ns_method``). Write a matrix with ``m <= n`` (a tall one is transposed by view). torch's NS costs
``ns_steps * (4 m^2 n + 2 m^3)`` FLOPs and, on the dev CPU, already runs near the bf16 matmul peak, so the gain
has to come from doing less work for the same polynomial:

* symmetric products: ``A = X X^T`` and ``A^2`` (and every ``m x m`` product of the Gram iteration) are
  symmetric, so on the CPU only the upper block triangle is computed (``nb`` row blocks: ``(nb + 1) / (2 nb)``
  of the FLOPs) and the lower blocks are copied from it;
* Gram-space iteration (``"gram"``) for rectangular matrices: ``X_k = Q_k X_0`` with ``Q_k`` an ``m x m``
  polynomial in ``R = X_0 X_0^T``; per iteration ``Z = b R + c R^2``, ``Q <- a Q + Q Z`` and
  ``R <- (a I + Z) R (a I + Z)``, all ``m x m`` (the same polynomial in exact arithmetic). In bf16 the carried
  ``R`` drifts from the true Gram matrix of ``Q X_0``, so the iteration *restarts* at ``gram_restarts``
  (``X <- Q X``, a fresh ``R``, ``Q <- I``), and a result whose Frobenius norm exceeds what the polynomial can
  produce (or is not finite) is recomputed with the standard iteration.
* ``"auto"`` (default) picks, per shape, the cheaper of the two by a FLOP model (Gram only for ``m >= 128``);
  ``"standard"`` always uses the (symmetric-blocked) standard iteration; ``"gram"`` uses the Gram iteration for
  every non-square matrix; ``"reference"`` runs torch's exact operations one matrix at a time (bit-identical to
  ``torch.optim.Muon`` for 2-D parameters).

On the CPU the matrices are processed one at a time with 2-D GEMMs into reused buffers, which is what lets the
symmetric products write their blocks in place (a batched bf16 ``bmm`` was no faster than a loop of ``mm``:
46.2 vs 45.8 ms for 8 x 1024^2, 12.7 vs 14.5 ms for 8 x 512x1024), except small ones (``min(m, n) < 256``),
which are stacked by shape and run as one batched computation (16 x 256^2: 1.9 ms batched, 5.9 ms looped). On
other devices all same-shape matrices (all experts of a layer, all same-shape projections) are stacked and run
batched, without symmetric blocking (not measured: no GPU was available). ``torch.compile`` is not used: it
gave nothing here (torch's NS on 1024x2048: 156 ms compiled, 158 ms eager, after a 6.8 s compile); the time is
in the GEMMs. Measurements: ``benchmarks/results.md`` ("Muon") and the comment at ``_CPU_BLOCK_ROWS`` below.

Distributed (``distributed``):

* ``"auto"`` (default): DTensor parameters sharded ``Shard(0)`` on a 1-D mesh (FSDP2 ``fully_shard``) are
  orthogonalised by one owner rank each: stacked expert weights are split on the expert dimension, so each rank
  orthogonalises its own experts with no communication; every 2-D matrix is assigned to one rank (greedy, largest
  first, balancing the FLOPs including the experts), its row shards are sent to the owner with one
  ``all_to_all`` for all matrices, the owner orthogonalises it and a second ``all_to_all`` returns each rank its
  rows. Shards may be uneven (FSDP2's ``torch.chunk`` rule: ``ceil(rows / world)`` rows per rank, the last ones
  shorter or empty). Plain tensors are orthogonalised locally.
* ``"owner"``: as ``"auto"``, and plain tensors are taken to be *replicated* on every rank of ``process_group``
  (DDP: the same parameters, in the same order, with the same gradients): each matrix (each expert of a 3-D
  parameter) is orthogonalised by one rank, balanced by FLOPs, and each rank broadcasts its results (one
  coalesced broadcast per rank); every rank applies every update, so parameters stay replicated. Momentum buffers
  stay full on every rank (they are cheap and keep the state dict unchanged).
* ``"local"``: no splitting. Plain tensors are orthogonalised locally; DTensors are all-gathered
  (``full_tensor()``) and every rank orthogonalises every matrix, then keeps its own shard (the simple version,
  kept for comparison and for placements the owner path does not handle: other meshes or placements also use it).

With any DTensor parameter, or with ``"owner"`` in a process group of more than one rank, ``step()`` is
collective: every rank must call it, with the same parameters having gradients. Results equal the single-process
ones: each matrix goes through the same code whichever rank computes it.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

try:  # DTensor is only available in builds with torch.distributed
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = Shard = None  # type: ignore[assignment,misc]

__all__ = ["Muon", "orthogonalize", "zeropower_via_newtonschulz", "ns_flops", "SCHEDULES"]

EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_NS_DTYPES = (torch.bfloat16, torch.float32)
NS_METHODS = ("auto", "standard", "gram", "reference")
DISTRIBUTED_MODES = ("auto", "owner", "local")

# Polar Express (Amsel, Persson, Musco, Gower 2025), 8 iterations fitted for bf16, the first 7 divided by the
# authors' safety factor 1.01 (a / 1.01, b / 1.01^3, c / 1.01^5); later iterations repeat the last triple.
_PE = ((8.28721201814563, -23.595886519098837, 17.300387312530933),
       (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
       (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
       (3.3184196573706015, -2.488488024314874, 0.51004894012372),
       (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
       (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
       (1.8750014808534479, -1.2500016453999487, 0.3750001645474248))
SCHEDULES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "keller": ((DEFAULT_A, DEFAULT_B, DEFAULT_C),),
    "polar_express": tuple((a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) for a, b, c in _PE) + ((1.875, -1.25, 0.375),),
}

# Gram-space restarts. Relative error of the bf16 result against an fp64 run of the same polynomial (5 Keller
# steps) on 512x1024, 512x4096, 256x2048, 128x2048, 600x2000 and 1024x2048, torch's bf16 NS in brackets:
#   Gaussian [0.010-0.014]: no restart 0.013-0.015, (2,) 0.014-0.016, (3,) 0.015-0.021, (2, 4) 0.013-0.017;
#   columns scaled 1..1e-3 [0.008-0.010]: (3,) 0.020-0.025, (2, 4) 0.015-0.020;
#   low rank + noise [0.19-0.20]: no restart 0.5-2.2 (drifted: largest singular value 9 instead of 1),
#     (2,) 0.21-0.28, (3,) 0.16-0.17, (2, 4) 0.17;
#   singular values 1..1e-4 [0.05-0.11]: no restart 0.3-1.3, (2,) 0.18-0.21, (3,) 0.045-0.099, (2, 4) 0.047-0.10.
# (3,) matches or beats torch on the structured inputs and stays within 1.5-3x its rounding noise on the others, at
# 0.57 of torch's FLOPs for 2048x4096 ((2, 4): 0.62); (2,) (Dao AI Lab's choice, with fp16, which this CPU cannot
# run fast) drifts in bf16. Training effect: benchmarks/results.md ("Muon").
DEFAULT_GRAM_RESTARTS = (3,)

# CPU block rows for symmetric products, and the size below which matrices are batched. Measured on the dev CPU
# (2 AVX-512 cores, machine idle-waited, median of 3), time relative to torch's NS for one matrix:
#   2048x4096: standard nb=1 0.98, nb=2 0.82, nb=4 0.77, nb=8 0.74; Gram (3,) nb=4 0.62, nb=8 0.59
#   2048x2048: standard nb=1 0.98, nb=2 0.88, nb=4 0.82, nb=8 0.82; Gram (3,) nb=4 0.91
#   1024x2048: standard nb=2 0.90, nb=4 0.85; Gram (3,) nb=1 0.87, nb=2 0.71, nb=4 0.75
#   256x2048:  standard nb=1 1.06, nb=2 1.02, nb=4 1.46; Gram (3,) nb=1 0.79, nb=2 1.16
# so blocks of 256 rows or more, at most 8 of them (2048 rows: 8 and 4 blocks within noise, 0.66 vs 0.70 and
# 0.82 vs 0.83 in a later run). The price of the blocks is the mirror copy of the lower triangle, a strided
# transposed copy: 5-14 ms for 2048^2 in bf16, about 130 of the 840 ms of one 4096x2048 NS (measured by
# skipping it); neither torch.compile nor a GEMM against the identity copied faster.
_CPU_BLOCK_ROWS = 256
_CPU_MAX_BLOCKS = 8
_CPU_SMALL = 256
_GRAM_MIN_ROWS = 128
_BATCH_ELEMENTS = 1 << 27  # largest stack [k, m, n] run in one batched call


def _is_dtensor(t: Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


# ----------------------------------------------------------------------------------------------------------------
# Coefficients


def _is_triple(c: Any) -> bool:
    return isinstance(c, (tuple, list)) and len(c) == 3 and all(isinstance(v, (int, float)) for v in c)


def _check_coefficients(c: Any) -> None:
    if isinstance(c, str):
        if c not in SCHEDULES:
            raise ValueError(f"unknown ns_coefficients schedule {c!r}; use one of {sorted(SCHEDULES)}")
        return
    if _is_triple(c):
        return
    if isinstance(c, (tuple, list)) and len(c) > 0 and all(_is_triple(t) for t in c):
        return
    raise ValueError("Coefficients must be a tuple of exactly 3 values, a sequence of such triples (one per "
                     f"iteration) or a schedule name {sorted(SCHEDULES)}; got {c!r}")


def _freeze_coefficients(c: Any) -> Any:
    if isinstance(c, str):
        return c
    if _is_triple(c):
        return tuple(float(v) for v in c)
    return tuple(tuple(float(v) for v in t) for t in c)


def iteration_coefficients(c: Any, steps: int) -> tuple[tuple[float, float, float], ...]:
    """The ``(a, b, c)`` of each of ``steps`` iterations (a schedule's last triple repeats)."""
    _check_coefficients(c)
    if isinstance(c, str):
        c = SCHEDULES[c]
    if _is_triple(c):
        return (tuple(float(v) for v in c),) * steps  # type: ignore[return-value]
    return tuple(tuple(float(v) for v in c[min(i, len(c) - 1)]) for i in range(steps))  # type: ignore[misc]


@functools.lru_cache(maxsize=64)
def _max_singular_value(coeffs: tuple[tuple[float, float, float], ...]) -> float:
    """Largest value the iterated scalar polynomial takes on [0, 1]: a bound on NS's output singular values."""
    s = torch.linspace(0, 1, 1 << 14, dtype=torch.float64)
    for a, b, c in coeffs:
        s2 = s * s
        s = s * (a + s2 * (b + c * s2))
    return float(s.abs().max())


# ----------------------------------------------------------------------------------------------------------------
# Newton-Schulz kernels


def zeropower_via_newtonschulz(
    x: Tensor,
    ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
    *,
    inplace: bool = False,
) -> Tensor:
    """torch's Newton-Schulz, for a matrix ``[m, n]`` or every matrix of a stack ``[k, m, n]`` (the reference).

    Returns a tensor of ``dtype`` and the shape of ``x``. For 2-D input the operations are those of
    ``torch.optim._muon._zeropower_via_newtonschulz`` (``addmm``), for 3-D their batched versions
    (``baddbmm``, per-matrix Frobenius norm). ``inplace=True`` lets the function overwrite ``x`` when it already
    has ``dtype`` (pass it only for a temporary the caller owns). ``ns_coefficients`` may also be a schedule.
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if x.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a matrix or a stack of matrices, got shape {tuple(x.shape)}")
    coeffs = iteration_coefficients(ns_coefficients, ns_steps)
    X = x.to(dtype, copy=not inplace)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    if X.ndim == 2:
        X.div_(X.norm().clamp(min=eps))
        for a, b, c in coeffs:
            gram = X @ X.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            X = torch.addmm(X, gram_update, X, beta=a)
    else:
        X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for a, b, c in coeffs:
            gram = X @ X.mT
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            X = torch.baddbmm(X, gram_update, X, beta=a)
    return X.mT if tall else X


class _Workspace:
    """Named scratch buffers, reused across matrices and steps (fresh memory costs page faults on the CPU)."""

    def __init__(self) -> None:
        self.buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        t = self.buffers.get(name)
        if t is None or t.shape != shape or t.dtype != dtype or t.device != device:
            self.buffers.pop(name, None)  # free the old one first
            t = torch.empty(shape, dtype=dtype, device=device)
            self.buffers[name] = t
        return t

    def clear(self) -> None:
        self.buffers.clear()


def _mm(a: Tensor, b: Tensor, out: Tensor) -> None:
    (torch.mm if a.ndim == 2 else torch.bmm)(a, b, out=out)


def _addmm(c: Tensor, a: Tensor, b: Tensor, beta: float, alpha: float, out: Tensor) -> None:
    (torch.addmm if a.ndim == 2 else torch.baddbmm)(c, a, b, beta=beta, alpha=alpha, out=out)


def _sym(out: Tensor, a: Tensor, b: Tensor, nb: int, c: Tensor | None = None, beta: float = 0.0,
         alpha: float = 1.0) -> Tensor:
    """``out = beta * c + alpha * a @ b`` for a result known to be symmetric (``c`` symmetric too).

    With ``nb > 1`` only the ``nb`` row blocks' upper triangles are multiplied (row block ``i`` against the
    columns from its diagonal on) and the lower blocks are copied from their transposes. ``out`` must not alias
    ``a``, ``b`` or ``c``.
    """
    m = out.size(-1)
    if nb <= 1:
        if c is None and alpha == 1.0:
            _mm(a, b, out)
        else:
            _addmm(out if c is None else c, a, b, beta if c is not None else 0.0, alpha, out)
        return out
    bounds = [m * i // nb for i in range(nb + 1)]
    for i in range(nb):
        r0, r1 = bounds[i], bounds[i + 1]
        o = out[..., r0:r1, r0:]
        if c is None and alpha == 1.0:
            _mm(a[..., r0:r1, :], b[..., :, r0:], o)
        else:
            _addmm(o if c is None else c[..., r0:r1, r0:], a[..., r0:r1, :], b[..., :, r0:],
                   beta if c is not None else 0.0, alpha, o)
    for i in range(1, nb):
        r0, r1 = bounds[i], bounds[i + 1]
        out[..., r0:r1, :r0].copy_(out[..., :r0, r0:r1].mT)
    return out


def _ns_standard(X: Tensor, out: Tensor, coeffs: Sequence[tuple[float, float, float]], nb: int,
                 ws: _Workspace) -> Tensor:
    """Standard quintic iteration on ``X [.., m, n]`` (normalised, ``m <= n``, overwritten) into ``out``."""
    if not coeffs:
        return out.copy_(X)
    mm_shape = X.shape[:-1] + (X.size(-2),)
    A = ws.get("A", mm_shape, X.dtype, X.device)
    B = ws.get("B", mm_shape, X.dtype, X.device)
    Y = ws.get("Y", X.shape, X.dtype, X.device)
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        _sym(A, X, X.mT, nb)
        _sym(B, A, A, nb, c=A, beta=b, alpha=c)
        dst = out if i == last else (Y if X is not Y else ws.get("Y2", X.shape, X.dtype, X.device))
        _addmm(X, B, X, a, 1.0, dst)
        X = dst
    return out


def _ns_gram(X: Tensor, out: Tensor, coeffs: Sequence[tuple[float, float, float]], nb: int, ws: _Workspace,
             restarts: Sequence[int]) -> Tensor:
    """Gram-space iteration (see the module docstring) on ``X [.., m, n]`` (normalised, ``m < n``) into ``out``.

    ``X`` itself is left unchanged, so the caller can rerun the standard iteration from it.
    """
    if not coeffs:
        return out.copy_(X)
    mm_shape = X.shape[:-1] + (X.size(-2),)
    R, Z, Q, Q2, RZ = (ws.get(k, mm_shape, X.dtype, X.device) for k in ("R", "Z", "Q", "Q2", "RZ"))
    _sym(R, X, X.mT, nb)
    have_q = False
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        if have_q and i in restarts:
            Y = ws.get("Y", X.shape, X.dtype, X.device)
            if Y is X:
                Y = ws.get("Y2", X.shape, X.dtype, X.device)
            _mm(Q, X, Y)
            X = Y
            _sym(R, X, X.mT, nb)
            have_q = False
        _sym(Z, R, R, nb, c=R, beta=b, alpha=c)  # Z = b R + c R^2
        if not have_q:
            Q.copy_(Z)
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = a I + Z
            have_q = True
        else:
            _sym(Q2, Q, Z, nb, c=Q, beta=a)  # Q (a I + Z)
            Q, Q2 = Q2, Q
        if i < last and (i + 1) not in restarts:
            _sym(RZ, R, Z, nb, c=R, beta=a)  # R (a I + Z)
            _sym(R, Z, RZ, nb, c=RZ, beta=a)  # (a I + Z) R (a I + Z)
    _mm(Q, X, out)
    return out


def _block_count(m: int, device: torch.device, batched: bool) -> int:
    if device.type != "cpu" or batched:
        return 1
    return max(1, min(_CPU_MAX_BLOCKS, m // _CPU_BLOCK_ROWS))


def ns_flops(m: int, n: int, steps: int, method: str, nb: int = 1,
             restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> float:
    """Modelled FLOPs of one NS of an ``m x n`` matrix (``m <= n``): ``"standard"``/``"reference"`` or ``"gram"``."""
    m, n = min(m, n), max(m, n)
    f = (nb + 1) / (2 * nb)  # share of a symmetric product computed with nb row blocks
    if method != "gram":
        return steps * (2 * m * m * n * (f if method == "standard" else 1.0) + 2 * m ** 3 * f + 2 * m * m * n)
    flops = 2 * m * m * n * f
    have_q = False
    for i in range(steps):
        if have_q and i in restarts:
            flops += 2 * m * m * n + 2 * m * m * n * f
            have_q = False
        flops += 2 * m ** 3 * f + (2 * m ** 3 * f if have_q else 0)
        have_q = True
        if i < steps - 1 and (i + 1) not in restarts:
            flops += 4 * m ** 3 * f
    return flops + 2 * m * m * n


@dataclass(frozen=True)
class _NSConfig:
    coeffs: tuple[tuple[float, float, float], ...]
    eps: float
    dtype: torch.dtype
    method: str
    restarts: tuple[int, ...]


def _plan(cfg: _NSConfig, m: int, n: int, device: torch.device, batched: bool) -> tuple[str, int]:
    """(method, row blocks) for an ``m x n`` matrix, ``m <= n``."""
    if cfg.method == "reference":
        return "reference", 1
    nb = _block_count(m, device, batched)
    if m == n or cfg.method == "standard" or not cfg.coeffs:
        return "standard", nb
    if cfg.method == "gram":
        return "gram", nb
    steps = len(cfg.coeffs)
    if m >= _GRAM_MIN_ROWS and ns_flops(m, n, steps, "gram", nb, cfg.restarts) < ns_flops(m, n, steps, "standard", nb):
        return "gram", nb
    return "standard", nb


def _orthogonalize_(X: Tensor, out: Tensor, cfg: _NSConfig, ws: _Workspace, batched: bool) -> tuple[Tensor, bool]:
    """Normalise ``X [.., m, n]`` (``m <= n``, ``cfg.dtype``, overwritten) and run NS into ``out``.

    Returns ``(out, fell_back)``; ``fell_back`` is true when a Gram result failed its check and was recomputed.
    """
    m, n = X.shape[-2:]
    if X.ndim == 2:
        X.div_(X.norm().clamp(min=cfg.eps))
    else:
        X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=cfg.eps))
    method, nb = _plan(cfg, m, n, X.device, batched)
    if method != "gram":
        return _ns_standard(X, out, cfg.coeffs, nb, ws), False
    _ns_gram(X, out, cfg.coeffs, nb, ws, cfg.restarts)
    # Drift check: the output's singular values cannot exceed the scalar polynomial's maximum on [0, 1], so
    # ||out||_F^2 <= m * bound^2 (with slack for rounding). A drifted Gram iteration overshoots it (measured
    # without restarts: largest singular value 9 instead of 1); recompute those with the standard iteration.
    bound = m * (1.1 * _max_singular_value(cfg.coeffs)) ** 2 + 1e-3
    fro2 = torch.linalg.vector_norm(out, dim=(-2, -1), dtype=torch.float32).square()
    bad = ~(fro2 <= bound)  # also catches NaN
    if not bool(bad.any()):
        return out, False
    return _ns_standard(X, out, cfg.coeffs, nb, ws), True


def orthogonalize(
    x: Tensor,
    ns_coefficients: Any = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
    method: str = "auto",
    gram_restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS,
    *,
    batched: bool | None = None,
) -> Tensor:
    """Muon's fast Newton-Schulz of a matrix ``[m, n]`` or of each matrix of a stack ``[k, m, n]``.

    Same polynomial as :func:`zeropower_via_newtonschulz`, computed as :class:`Muon` does (``method``: see the
    module docstring). Returns a new tensor of ``dtype`` and the shape of ``x`` (a transposed view if tall).
    ``batched`` forces the batched form for a stack (default: as Muon chooses for the device).
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a matrix or a stack of matrices, got shape {tuple(x.shape)}")
    if method not in NS_METHODS:
        raise ValueError(f"method must be one of {NS_METHODS}, got {method!r}")
    cfg = _NSConfig(iteration_coefficients(ns_coefficients, ns_steps), float(eps), dtype, method,
                    tuple(gram_restarts))
    if method == "reference":
        return zeropower_via_newtonschulz(x, cfg.coeffs, ns_steps, eps, dtype)  # type: ignore[arg-type]
    tall = x.size(-2) > x.size(-1)
    ws = _Workspace()
    if batched is None:
        batched = x.device.type != "cpu" or min(x.shape[-2:]) < _CPU_SMALL
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.ndim == 3 and not batched:
        for k in range(x.size(0)):
            X = ws.get("X", tuple(x.shape[1:]), dtype, x.device)
            X.copy_(x[k])
            _orthogonalize_(X.mT if tall else X, out[k].mT if tall else out[k], cfg, ws, False)
    else:
        X = x.to(dtype, memory_format=torch.contiguous_format, copy=True)
        _orthogonalize_(X.mT if tall else X, out.mT if tall else out, cfg, ws, batched or x.ndim == 3)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The optimizer


def _adjust_lr(lr: float, adjust_lr_fn: str | None, matrix_shape: tuple[int, int]) -> float:
    """torch's lr adjustment, for the shape ``(out, in)`` of one matrix (one expert for a 3-D parameter)."""
    A, B = matrix_shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    else:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    return lr * ratio


def _chunk_sizes(n: int, world: int) -> list[int]:
    """Rows per rank of a ``Shard(0)`` DTensor with ``n`` rows (``torch.chunk``'s rule, which FSDP2 uses)."""
    c = -(-n // world) if n else 0
    return [max(0, min(c, n - r * c)) for r in range(world)]


def _assign(costs: Sequence[float], world: int, load: list[float] | None = None) -> list[int]:
    """Owner of each item: largest first, each to the least-loaded rank (ties: lower index, lower rank)."""
    load = list(load) if load is not None else [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


@dataclass
class _Entry:
    """One parameter with a gradient this step, after the momentum update (local tensors for DTensors)."""

    param: Tensor
    p_local: Tensor
    grad: Tensor
    buf: Tensor
    nesterov: bool
    momentum: float
    cfg: _NSConfig
    decay: float
    adjusted_lr: float

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.param.shape[-2:])  # type: ignore[return-value]

    def fill(self, dst: Tensor, index: int | None = None, rows: slice | None = None) -> None:
        """Write the update ``U`` of local matrix ``index`` (rows ``rows``) into ``dst`` (casting)."""
        g, b = self.grad, self.buf
        if index is not None:
            g, b = g[index], b[index]
        if rows is not None:
            g, b = g[rows], b[rows]
        if self.nesterov:
            torch.lerp(g, b, self.momentum, out=dst)
        else:
            dst.copy_(b)

    def apply(self, ortho: Tensor, index: int | None = None, target: Tensor | None = None) -> None:
        p = self.p_local if target is None else target
        if index is not None:
            p = p[index]
        p.mul_(self.decay)
        p.add_(ortho, alpha=-self.adjusted_lr)


@dataclass
class _Task:
    """One matrix to orthogonalise: ``fill(dst)`` writes its update, ``sink(O)`` consumes the result."""

    m0: int
    n0: int
    cfg: _NSConfig
    device: torch.device
    fill: Callable[[Tensor], None]
    sink: Callable[[Tensor], None]
    param_dtype: torch.dtype


def _dtype_name(dtype: Any) -> str:
    """"bfloat16" or "float32" from a torch.dtype or its name; anything else is refused."""
    name = str(dtype).removeprefix("torch.")
    if getattr(torch, name, None) not in _NS_DTYPES:
        raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    return name


class Muon(Optimizer):
    """Muon for 2-D and stacked 3-D ``[E, out, in]`` parameters, plain tensors or DTensors (see module docstring).

    Args mirror :class:`torch.optim.Muon` (``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
    ``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``), plus ``ns_dtype`` (``torch.bfloat16`` or
    ``torch.float32``: the dtype of the Newton-Schulz iteration), ``ns_method`` (``"auto"``, ``"standard"``,
    ``"gram"`` or ``"reference"``), ``gram_restarts`` (iterations at which the Gram iteration restarts),
    ``distributed`` (``"auto"``, ``"owner"`` or ``"local"``) and ``process_group`` (for ``"owner"`` with plain
    tensors; default: the world). ``ns_coefficients`` may also be a sequence of triples (one per iteration) or
    ``"polar_express"``. All but ``distributed`` and ``process_group`` can be set per parameter group.
    Use another optimizer (AdamW) for embeddings, norms, biases and other non-matrix parameters.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        *,
        ns_method: str = "auto",
        gram_restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS,
        distributed: str = "auto",
        process_group: Any = None,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if distributed not in DISTRIBUTED_MODES:
            raise ValueError(f"distributed must be one of {DISTRIBUTED_MODES}, got {distributed!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        ns_dtype=ns_dtype, ns_method=ns_method, gram_restarts=gram_restarts)
        self.distributed = distributed
        self.process_group = process_group
        self.gram_fallbacks = 0  # Gram results that failed the drift check and were recomputed (diagnostics)
        self.ns_matrices = 0  # matrices this rank orthogonalised in the last step (diagnostics)
        self._ws = _Workspace()
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # also runs at the end of load_state_dict
        for group in self.param_groups:  # groups saved by an older version lack the newer options
            for key in ("ns_method", "gram_restarts"):
                group.setdefault(key, self.defaults.get(key, "auto" if key == "ns_method" else
                                                        DEFAULT_GRAM_RESTARTS))
        self.__dict__.setdefault("distributed", "auto")
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("gram_fallbacks", 0)
        self.__dict__.setdefault("ns_matrices", 0)
        self.__dict__.setdefault("_ws", _Workspace())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Checks a group's options; ``ns_dtype`` is kept by name ("bfloat16"/"float32") so that the optimizer's
        state_dict holds only plain values (distributed checkpointing cannot carry a torch.dtype)."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            if p.ndim not in (2, 3):
                raise ValueError(
                    "Muon only supports 2-D parameters [out, in] and stacked 3-D parameters [E, out, in]; "
                    f"got a parameter with shape {tuple(p.shape)}")
            if torch.is_complex(p):
                raise ValueError("Muon does not support complex parameters")
        # Per-group overrides get the constructor's checks too.
        for key, value in self.defaults.items():
            param_group.setdefault(key, value)
        if param_group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
            raise ValueError(
                f"Adjust learning rate function {param_group['adjust_lr_fn']!r} is not supported; use one of "
                f"{_ADJUST_LR_FNS}")
        param_group["ns_dtype"] = _dtype_name(param_group["ns_dtype"])
        if param_group["ns_method"] not in NS_METHODS:
            raise ValueError(f"ns_method must be one of {NS_METHODS}, got {param_group['ns_method']!r}")
        if not 0 <= param_group["ns_steps"] < 100:
            raise ValueError(f"ns_steps must be in [0, 99], got {param_group['ns_steps']}")
        _check_coefficients(param_group["ns_coefficients"])
        param_group["ns_coefficients"] = _freeze_coefficients(param_group["ns_coefficients"])
        param_group["gram_restarts"] = tuple(int(i) for i in param_group["gram_restarts"])
        param_group["params"] = params
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimisation step (collective over ranks: see "Distributed" in the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries: list[_Entry] = []
        self.ns_matrices = 0
        for group in self.param_groups:
            lr = group["lr"]
            lr = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
            cfg = _NSConfig(iteration_coefficients(group["ns_coefficients"], group["ns_steps"]), float(group["eps"]),
                            getattr(torch, _dtype_name(group["ns_dtype"])), group["ns_method"],
                            tuple(group["gram_restarts"]))
            momentum = group["momentum"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                g_local, buf_local = _local(grad), _local(buf)
                buf_local.lerp_(g_local, 1 - momentum)
                entries.append(_Entry(p, _local(p), g_local, buf_local, group["nesterov"], momentum, cfg,
                                      1 - lr * group["weight_decay"],
                                      _adjust_lr(lr, group["adjust_lr_fn"], tuple(p.shape[-2:]))))
        self._update(entries)
        return loss

    def _update(self, entries: list[_Entry]) -> None:
        local: list[_Entry] = []
        gathered: list[_Entry] = []
        sharded: dict[Any, list[_Entry]] = {}
        replicated: list[_Entry] = []
        group = self._replica_group()
        for e in entries:
            if _is_dtensor(e.param):
                mesh = e.param.device_mesh
                if mesh.size() == 1:
                    local.append(e)
                elif self.distributed != "local" and mesh.ndim == 1 and tuple(e.param.placements) == (Shard(0),):
                    sharded.setdefault(mesh, []).append(e)
                else:
                    gathered.append(e)
            elif group is not None:
                replicated.append(e)
            else:
                local.append(e)
        # Same order on every rank: the collectives of each part are issued in entry order.
        if gathered:
            self._update_gathered(gathered)
        for mesh, part in sharded.items():
            self._update_sharded(mesh, part)
        if replicated:
            self._update_replicated(replicated, group)
        if local:
            self._run(self._local_tasks(local))

    def _replica_group(self) -> Any:
        if self.distributed != "owner" or not dist.is_available() or not dist.is_initialized():
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    # --- execution --------------------------------------------------------------------------------------------

    def _run(self, tasks: list[_Task]) -> None:
        """Orthogonalise every task: big CPU matrices one at a time, the rest stacked by shape."""
        batches: dict[tuple, list[_Task]] = defaultdict(list)
        self.ns_matrices += len(tasks)
        for t in tasks:
            if t.cfg.method == "reference":
                self._run_reference(t)
            elif t.device.type == "cpu" and min(t.m0, t.n0) >= _CPU_SMALL:
                self._run_one(t)
            else:
                batches[(t.m0, t.n0, t.cfg, t.device)].append(t)
        for (m0, n0, cfg, device), ts in batches.items():
            per = max(1, _BATCH_ELEMENTS // (m0 * n0))
            for s in range(0, len(ts), per):
                self._run_batch(ts[s:s + per], m0, n0, cfg, device)

    def _run_reference(self, t: _Task) -> None:
        u = self._ws.get("U", (t.m0, t.n0), t.param_dtype, t.device)
        t.fill(u)
        t.sink(zeropower_via_newtonschulz(u, t.cfg.coeffs, len(t.cfg.coeffs), t.cfg.eps, t.cfg.dtype))

    # Input and output buffers keep the parameter's layout; a tall matrix is iterated on as their transposed
    # views (matmuls take transposed operands and write transposed outputs at full speed). Filling or reading a
    # contiguous transposed copy instead costs an extra strided pass: 38 ms instead of 17 ms for the Nesterov
    # lerp + cast of one 4096x2048 expert, measured.

    def _run_one(self, t: _Task) -> None:
        tall = t.m0 > t.n0
        X = self._ws.get("X", (t.m0, t.n0), t.cfg.dtype, t.device)
        t.fill(X)  # the Nesterov update, cast, in one pass
        out = self._ws.get("O", (t.m0, t.n0), t.cfg.dtype, t.device)
        _, fell_back = _orthogonalize_(X.mT if tall else X, out.mT if tall else out, t.cfg, self._ws,
                                       batched=False)
        self.gram_fallbacks += int(fell_back)
        t.sink(out)

    def _run_batch(self, ts: list[_Task], m0: int, n0: int, cfg: _NSConfig, device: torch.device) -> None:
        tall = m0 > n0
        ws = _Workspace()  # stacks vary in size: free them with the batch
        X = ws.get("X", (len(ts), m0, n0), cfg.dtype, device)
        for k, t in enumerate(ts):
            t.fill(X[k])
        out = ws.get("O", (len(ts), m0, n0), cfg.dtype, device)
        _, fell_back = _orthogonalize_(X.mT if tall else X, out.mT if tall else out, cfg, ws, batched=True)
        self.gram_fallbacks += int(fell_back)
        for k, t in enumerate(ts):
            t.sink(out[k])

    @staticmethod
    def _matrices(e: _Entry) -> list[int | None]:
        return [None] if e.p_local.ndim == 2 else list(range(e.p_local.size(0)))

    def _local_tasks(self, entries: list[_Entry]) -> list[_Task]:
        tasks = []
        for e in entries:
            m0, n0 = e.shape
            for i in self._matrices(e):
                tasks.append(_Task(m0, n0, e.cfg, e.p_local.device, functools.partial(e.fill, index=i),
                                   functools.partial(e.apply, index=i), e.grad.dtype))
        return tasks

    @staticmethod
    def _cost(e: _Entry) -> float:
        m0, n0 = e.shape
        m, n = min(m0, n0), max(m0, n0)
        method, nb = _plan(e.cfg, m, n, e.p_local.device, m < _CPU_SMALL)
        return ns_flops(m, n, len(e.cfg.coeffs), method, nb, e.cfg.restarts)

    # --- DDP: replicated parameters, one owner per matrix, results broadcast ----------------------------------

    def _update_replicated(self, entries: list[_Entry], group: Any) -> None:
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        items = [(e, i) for e in entries for i in self._matrices(e)]
        owner = _assign([self._cost(e) for e, _ in items], world)
        # Each owner's results, coalesced in item order, one flat buffer per (owner, ns dtype).
        layout: dict[tuple[int, torch.dtype], int] = defaultdict(int)
        offsets = []
        for (e, _), r in zip(items, owner):
            key = (r, e.cfg.dtype)
            offsets.append(layout[key])
            layout[key] += e.shape[0] * e.shape[1]
        device = entries[0].p_local.device
        flats = {key: torch.empty(size, dtype=key[1], device=device) for key, size in layout.items()}

        def sink(flat: Tensor, off: int, m0: int, n0: int, ortho: Tensor) -> None:
            flat[off:off + m0 * n0].view(m0, n0).copy_(ortho)

        tasks = []
        for (e, i), r, off in zip(items, owner, offsets):
            if r == rank:
                m0, n0 = e.shape
                tasks.append(_Task(m0, n0, e.cfg, device, functools.partial(e.fill, index=i),
                                   functools.partial(sink, flats[(r, e.cfg.dtype)], off, m0, n0), e.grad.dtype))
        self._run(tasks)
        global_ranks = [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r for r in range(world)]
        works = {key: dist.broadcast(flat, src=global_ranks[key[0]], group=group, async_op=True)
                 for key, flat in sorted(flats.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))}
        for (e, i), r, off in zip(items, owner, offsets):
            key = (r, e.cfg.dtype)
            if works.get(key) is not None:
                works.pop(key).wait()
            m0, n0 = e.shape
            e.apply(flats[key][off:off + m0 * n0].view(m0, n0), index=i)
        for w in works.values():
            w.wait()

    # --- FSDP2: Shard(0) DTensors; experts local, 2-D matrices gathered to an owner -----------------------------

    def _update_sharded(self, mesh: Any, entries: list[_Entry]) -> None:
        world = mesh.size()
        rank = mesh.get_local_rank()
        group = mesh.get_group()
        device = entries[0].p_local.device
        load = [0.0] * world
        expert_entries, matrices = [], []
        for e in entries:
            sizes = _chunk_sizes(e.param.shape[0], world)
            if e.p_local.shape[0] != sizes[rank]:
                raise RuntimeError(
                    f"Muon: a Shard(0) DTensor of shape {tuple(e.param.shape)} has {e.p_local.shape[0]} local rows "
                    f"on rank {rank}, expected {sizes[rank]} (torch.chunk's rule); use distributed='local'")
            if e.param.ndim == 3:
                expert_entries.append(e)
                cost = self._cost(e)
                for r in range(world):
                    load[r] += sizes[r] * cost
            else:
                starts = [sum(sizes[:r]) for r in range(world)]
                matrices.append((e, sizes, starts))
        owner = _assign([self._cost(e) for e, _, _ in matrices], world, load)
        mine = [j for j, r in enumerate(owner) if r == rank]

        # Phase 1: every rank sends its rows of each matrix to the matrix's owner (one all_to_all).
        send_split = [0] * world
        send_at: dict[int, int] = {}
        for d in range(world):
            for j, (e, sizes, _) in enumerate(matrices):
                if owner[j] == d:
                    send_at[j] = sum(send_split[:d]) + send_split[d]
                    send_split[d] += sizes[rank] * e.shape[1]
        recv_split = [0] * world
        recv_at: dict[tuple[int, int], int] = {}
        for s in range(world):
            for j in mine:
                e, sizes, _ = matrices[j]
                recv_at[(s, j)] = sum(recv_split[:s]) + recv_split[s]
                recv_split[s] += sizes[s] * e.shape[1]
        dtype = matrices[0][0].cfg.dtype if matrices else entries[0].cfg.dtype
        if any(e.cfg.dtype != dtype for e, _, _ in matrices):
            raise ValueError("Muon: FSDP parameters sharing a mesh must use one ns_dtype")
        send = torch.empty(sum(send_split), dtype=dtype, device=device)
        for j, (e, sizes, _) in enumerate(matrices):
            rows = sizes[rank]
            if rows:
                e.fill(send[send_at[j]:send_at[j] + rows * e.shape[1]].view(rows, e.shape[1]))
        recv = torch.empty(sum(recv_split), dtype=dtype, device=device)
        work = dist.all_to_all_single(recv, send, recv_split, send_split, group=group, async_op=True) \
            if matrices else None

        # Meanwhile: this rank's own experts (no communication).
        self._run(self._local_tasks(expert_entries))
        if work is not None:
            work.wait()
        else:
            return
        del send

        # Phase 2: owners orthogonalise and send each rank its rows back (second all_to_all). The layout is phase
        # 1's mirrored: what this rank received from each rank it sends back, where it sent, it receives.
        back_split, back_at = recv_split, recv_at
        ret_split, ret_at = send_split, send_at
        back = torch.empty(sum(back_split), dtype=dtype, device=device)

        def fill(j: int, dst: Tensor) -> None:
            e, sizes, starts = matrices[j]
            n0 = e.shape[1]
            for s in range(world):
                if sizes[s]:
                    at = recv_at[(s, j)]
                    dst[starts[s]:starts[s] + sizes[s]].copy_(recv[at:at + sizes[s] * n0].view(sizes[s], n0))

        def sink(j: int, ortho: Tensor) -> None:
            e, sizes, starts = matrices[j]
            n0 = e.shape[1]
            for d in range(world):
                if sizes[d]:
                    at = back_at[(d, j)]
                    back[at:at + sizes[d] * n0].view(sizes[d], n0).copy_(ortho[starts[d]:starts[d] + sizes[d]])

        tasks = [_Task(*matrices[j][0].shape, matrices[j][0].cfg, device, functools.partial(fill, j),
                       functools.partial(sink, j), dtype) for j in mine]
        self._run(tasks)
        del recv
        ret = torch.empty(sum(ret_split), dtype=dtype, device=device)
        dist.all_to_all_single(ret, back, ret_split, back_split, group=group)
        for j, (e, sizes, _) in enumerate(matrices):
            rows = sizes[rank]
            if rows:
                e.apply(ret[ret_at[j]:ret_at[j] + rows * e.shape[1]].view(rows, e.shape[1]))

    # --- fallback: gather every matrix on every rank ------------------------------------------------------------

    def _update_gathered(self, entries: list[_Entry]) -> None:
        for e in entries:
            full_u = DTensor.from_local(
                e.grad.lerp(e.buf, e.momentum) if e.nesterov else e.buf, e.param.device_mesh, e.param.placements,
                shape=e.param.shape, stride=e.param.stride(), run_check=False,
            ).to(e.cfg.dtype).full_tensor()
            ortho_full = torch.empty_like(full_u)
            m0, n0 = e.shape
            idx = [None] if full_u.ndim == 2 else list(range(full_u.size(0)))

            def fill(i: int | None, dst: Tensor, src: Tensor = full_u) -> None:
                dst.copy_(src if i is None else src[i])

            def sink(i: int | None, ortho: Tensor, out: Tensor = ortho_full) -> None:
                (out if i is None else out[i]).copy_(ortho)

            self._run([_Task(m0, n0, e.cfg, full_u.device, functools.partial(fill, i), functools.partial(sink, i),
                             e.cfg.dtype) for i in idx])
            e.apply(_local(_local_shard_of(ortho_full, e.param)))


def _local_shard_of(full: Tensor, like: Tensor) -> Tensor:
    """``full`` (the same on every rank) as a DTensor placed like ``like``: a local slice, no communication."""
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements)
