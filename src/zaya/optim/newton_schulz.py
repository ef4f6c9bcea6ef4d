"""Newton-Schulz (NS) orthogonalisation for Muon: the coefficient schedules, torch's reference iteration and the
fast kernels.

Pure math on tensors: it knows nothing of parameters, momentum or ranks, so that the optimizer (``zaya.optim.muon``)
and its distributed execution (``zaya.optim.muon_distributed``) share one definition of "orthogonalise this
matrix", and every rank, whichever matrices it is given, computes them with the same code (which is what makes the
distributed results equal the single-process ones). The speed comes from doing fewer FLOPs for the same
polynomial: symmetric products computed by upper block triangle (row blocks on the CPU, the Triton kernel of
``zaya.optim.newton_schulz_triton`` on a GPU, ``triton_products``), and a Gram-space iteration for
rectangular matrices with restarts and a drift check (``drift_flags``, returned as a device tensor for the caller
to read when it chooses; ``standard_`` recomputes a flagged result). ``method`` picks per shape; ``stacked`` runs
a list of matrices (one at a time or batched); the CPU constants come from the hardware profile
(``zaya.core.hardware``). The algorithm: docs/training.md, "Muon and Newton-Schulz"; measurements:
benchmarks/results.md, "Muon".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import torch
from torch import Tensor

from zaya.core.hardware import load_profile
from zaya.core.kernels import guarded, kernel_module, triton_device

__all__ = ["orthogonalize", "zeropower_via_newtonschulz", "ns_flops", "iteration_coefficients", "SCHEDULES",
           "NSConfig", "Workspace", "plan", "stacked", "gram_checked", "orthogonalize_", "standard_",
           "drift_flags", "triton_products"]

EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5
NS_DTYPES = (torch.bfloat16, torch.float32)
NS_METHODS = ("auto", "standard", "gram", "reference")

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

# CPU block rows for symmetric products, and the size below which matrices are batched: the hardware profile's
# muon_block_rows = 256, muon_max_blocks = 8 and muon_cpu_small = 256 unless a profile says otherwise. Measured on
# the dev CPU (2 AVX-512 cores, machine idle-waited, median of 3), time relative to torch's NS for one matrix:
#   2048x4096: standard nb=1 0.98, nb=2 0.82, nb=4 0.77, nb=8 0.74; Gram (3,) nb=4 0.62, nb=8 0.59
#   2048x2048: standard nb=1 0.98, nb=2 0.88, nb=4 0.82, nb=8 0.82; Gram (3,) nb=4 0.91
#   1024x2048: standard nb=2 0.90, nb=4 0.85; Gram (3,) nb=1 0.87, nb=2 0.71, nb=4 0.75
#   256x2048:  standard nb=1 1.06, nb=2 1.02, nb=4 1.46; Gram (3,) nb=1 0.79, nb=2 1.16
# so blocks of 256 rows or more, at most 8 of them (2048 rows: 8 and 4 blocks within noise, 0.66 vs 0.70 and
# 0.82 vs 0.83 in a later run). The price of the blocks is the mirror copy of the lower triangle, a strided
# transposed copy: 5-14 ms for 2048^2 in bf16, about 130 of the 840 ms of one 4096x2048 NS (measured by
# skipping it); neither torch.compile nor a GEMM against the identity copied faster.
_GRAM_MIN_ROWS = 128
BATCH_ELEMENTS = 1 << 27  # largest stack [k, m, n] run in one batched call


# ----------------------------------------------------------------------------------------------------------------
# Coefficients


def _is_triple(c: Any) -> bool:
    return isinstance(c, (tuple, list)) and len(c) == 3 and all(isinstance(v, (int, float)) for v in c)


def check_coefficients(c: Any) -> None:
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


def freeze_coefficients(c: Any) -> Any:
    if isinstance(c, str):
        return c
    if _is_triple(c):
        return tuple(float(v) for v in c)
    return tuple(tuple(float(v) for v in t) for t in c)


def iteration_coefficients(c: Any, steps: int) -> tuple[tuple[float, float, float], ...]:
    """The ``(a, b, c)`` of each of ``steps`` iterations (a schedule's last triple repeats)."""
    check_coefficients(c)
    if isinstance(c, str):
        c = SCHEDULES[c]
    if _is_triple(c):
        return (tuple(float(v) for v in c),) * steps  # type: ignore[return-value]
    return tuple(tuple(float(v) for v in c[min(i, len(c) - 1)]) for i in range(steps))  # type: ignore[misc]


@functools.lru_cache(maxsize=64)
def max_singular_value(coeffs: tuple[tuple[float, float, float], ...]) -> float:
    """Largest value the iterated scalar polynomial takes on [0, 1]: a bound on NS's output singular values.

    Plain Python floats on torch.linspace's 16384 points (the same values, bit for bit, as the float64 tensor
    computation it replaces, measured for both schedules), so that no tensor is read back to the host inside an
    optimizer step; it runs once per schedule (about 0.15 s) and is cached.
    """
    n = 1 << 14
    step = 1.0 / (n - 1)
    best = 0.0
    for i in range(n):
        s = step * i if i < n // 2 else 1.0 - step * (n - 1 - i)  # torch.linspace's symmetric formula
        for a, b, c in coeffs:
            s2 = s * s
            s = s * (a + s2 * (b + c * s2))
        best = max(best, abs(s))
    return best


# ----------------------------------------------------------------------------------------------------------------
# The reference


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


# ----------------------------------------------------------------------------------------------------------------
# Fast kernels


class Workspace:
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


@kernel_module
def _kernels() -> ModuleType:
    """The Triton kernel module, or None where triton does not import (imported on the first GPU product only)."""
    from zaya.optim import newton_schulz_triton

    return newton_schulz_triton


KERNEL = "newton_schulz_symmetric_products"
"""The kernel's name for ``zaya.core.kernels`` (its switch-off after a failure, the warning)."""


def triton_products(device: torch.device, dtype: torch.dtype, m: int) -> bool:
    """Whether the symmetric products of ``m``-row matrices of ``dtype`` on ``device`` run in the Triton kernel:
    a GPU and triton (``zaya.core.kernels``), a dtype the kernel compiles there (bf16 or fp32), and more than one
    tile's rows (one tile saves nothing). Elsewhere they are torch's GEMMs (by row blocks on the CPU)."""
    if not triton_device(device, KERNEL):
        return False
    kernels = _kernels()
    return kernels is not None and m > kernels.TILE and kernels.supports(device, dtype)


def _sym(out: Tensor, a: Tensor, b: Tensor, nb: int, c: Tensor | None = None, beta: float = 0.0,
         alpha: float = 1.0) -> Tensor:
    """``out = beta * c + alpha * a @ b`` for a result known to be symmetric (``c`` symmetric too).

    Where ``triton_products`` says so, the Triton kernel (upper tiles only, mirrored, epilogue fused; ``nb`` is not
    used; should it fail, torch's GEMM, ``zaya.core.kernels.guarded``). Otherwise, with ``nb > 1`` only the ``nb``
    row blocks' upper triangles are multiplied (row block ``i`` against the columns from its diagonal on) and the
    lower blocks are copied from their transposes. ``out`` must not alias ``a``, ``b`` or ``c``.
    """
    m = out.size(-1)
    if triton_products(out.device, out.dtype, m):
        return guarded(KERNEL, lambda: _kernels().sym_matmul(out, a, b, c, beta, alpha),
                       lambda: _sym(out, a, b, 1, c, beta, alpha))
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
                 ws: Workspace) -> Tensor:
    """Standard quintic iteration on ``X [.., m, n]`` (normalised, ``m <= n``) into ``out``; ``X`` is not written
    unless it is one of ``ws``'s ``Y`` buffers."""
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


def _ns_gram(X: Tensor, out: Tensor, coeffs: Sequence[tuple[float, float, float]], nb: int, ws: Workspace,
             restarts: Sequence[int]) -> Tensor:
    """Gram-space iteration (docs/training.md, "Muon and Newton-Schulz") on ``X [.., m, n]`` (normalised,
    ``m < n``) into ``out``.

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


def _block_count(m: int, device: torch.device, batched: bool, dtype: torch.dtype) -> int:
    """Row blocks of the symmetric products of an ``m``-row matrix: on the CPU one at a time, the profile's sizes;
    with the Triton kernel its row tiles (the FLOP share of upper tiles is that of as many row blocks); else 1."""
    if device.type != "cpu":
        return -(-m // _kernels().TILE) if triton_products(device, dtype, m) else 1
    if batched:
        return 1
    profile = load_profile(device)
    return max(1, min(profile.muon_max_blocks, m // profile.muon_block_rows))


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


# ----------------------------------------------------------------------------------------------------------------
# Per-shape plan, and one matrix (or one stack) orthogonalised


@dataclass(frozen=True)
class NSConfig:
    """Everything the NS of one matrix depends on (hashable: same-config matrices are stacked together)."""

    coeffs: tuple[tuple[float, float, float], ...]
    eps: float
    dtype: torch.dtype
    method: str
    restarts: tuple[int, ...]


def stacked(m0: int, n0: int, device: torch.device) -> bool:
    """Whether the optimizer runs an ``m0 x n0`` matrix stacked with others of its shape (else one at a time):
    always off the CPU; on it, below the profile's ``muon_cpu_small``."""
    return device.type != "cpu" or min(m0, n0) < load_profile(device).muon_cpu_small


def plan(cfg: NSConfig, m: int, n: int, device: torch.device, batched: bool) -> tuple[str, int]:
    """(method, row blocks) for an ``m x n`` matrix, ``m <= n``."""
    if cfg.method == "reference":
        return "reference", 1
    nb = _block_count(m, device, batched, cfg.dtype)
    if m == n or cfg.method == "standard" or not cfg.coeffs:
        return "standard", nb
    if cfg.method == "gram":
        return "gram", nb
    steps = len(cfg.coeffs)
    if m >= _GRAM_MIN_ROWS and ns_flops(m, n, steps, "gram", nb, cfg.restarts) < ns_flops(m, n, steps, "standard", nb):
        return "gram", nb
    return "standard", nb


def gram_checked(m0: int, n0: int, cfg: NSConfig, device: torch.device) -> bool:
    """Whether the optimizer's NS of an ``m0 x n0`` matrix is a Gram iteration, and so yields a drift check.

    Known from the shape alone, so every rank of a distributed step can lay out room for the checks of matrices
    other ranks orthogonalise.
    """
    if cfg.method == "reference":
        return False
    return plan(cfg, min(m0, n0), max(m0, n0), device, stacked(m0, n0, device))[0] == "gram"


def drift_flags(out: Tensor, cfg: NSConfig) -> Tensor:
    """Drift check of Gram results ``out [.., m, n]`` (``m <= n``): a bool tensor of shape ``out.shape[:-2]``,
    true where the result must be recomputed with the standard iteration. Nothing is read to the host.

    The output's singular values cannot exceed the scalar polynomial's maximum on [0, 1], so
    ``||out||_F^2 <= m * bound^2`` (with slack for rounding). A drifted Gram iteration overshoots it (measured
    without restarts: largest singular value 9 instead of 1); a NaN or an infinity fails too.
    """
    m = out.size(-2)
    bound = m * (1.1 * max_singular_value(cfg.coeffs)) ** 2 + 1e-3
    fro2 = torch.linalg.vector_norm(out, dim=(-2, -1), dtype=torch.float32).square()
    return ~(fro2 <= bound)


def orthogonalize_(X: Tensor, out: Tensor, cfg: NSConfig, ws: Workspace, batched: bool) -> Tensor | None:
    """Normalise ``X [.., m, n]`` (``m <= n``, ``cfg.dtype``, overwritten) and run NS into ``out``.

    Returns the drift check (``drift_flags``, on the device) when the Gram iteration was used, else None. A
    flagged result is *not* recomputed here; ``X`` still holds the normalised input, from which ``standard_``
    computes the fallback.
    """
    m, n = X.shape[-2:]
    if X.ndim == 2:
        X.div_(X.norm().clamp(min=cfg.eps))
    else:
        X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=cfg.eps))
    method, nb = plan(cfg, m, n, X.device, batched)
    if method != "gram":
        _ns_standard(X, out, cfg.coeffs, nb, ws)
        return None
    _ns_gram(X, out, cfg.coeffs, nb, ws, cfg.restarts)
    return drift_flags(out, cfg)


def standard_(X: Tensor, out: Tensor, cfg: NSConfig, ws: Workspace, batched: bool) -> Tensor:
    """The fallback of a Gram run: the standard iteration (with the plan's row blocks) from ``X`` as
    ``orthogonalize_`` left it (normalised), into ``out``."""
    m, n = X.shape[-2:]
    return _ns_standard(X, out, cfg.coeffs, plan(cfg, m, n, X.device, batched)[1], ws)


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

    Same polynomial as :func:`zeropower_via_newtonschulz`, computed as :class:`~zaya.optim.Muon` does (``method``:
    docs/training.md, "Muon and Newton-Schulz"). Returns a new tensor of ``dtype`` and the shape of ``x`` (a
    transposed view if tall). ``batched`` forces the batched form for a stack (default: as Muon chooses for the
    device). A Gram result that fails its drift check is recomputed with the standard iteration here and now (one
    host read per Gram run; the whole stack when batched).
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a matrix or a stack of matrices, got shape {tuple(x.shape)}")
    if method not in NS_METHODS:
        raise ValueError(f"method must be one of {NS_METHODS}, got {method!r}")
    cfg = NSConfig(iteration_coefficients(ns_coefficients, ns_steps), float(eps), dtype, method,
                   tuple(gram_restarts))
    if method == "reference":
        return zeropower_via_newtonschulz(x, cfg.coeffs, ns_steps, eps, dtype)  # type: ignore[arg-type]
    tall = x.size(-2) > x.size(-1)
    ws = Workspace()
    if batched is None:
        batched = stacked(x.size(-2), x.size(-1), x.device)

    def run(X: Tensor, out: Tensor, as_batch: bool) -> None:
        flags = orthogonalize_(X, out, cfg, ws, as_batch)
        if flags is not None and bool(flags.any()):
            standard_(X, out, cfg, ws, as_batch)

    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.ndim == 3 and not batched:
        for k in range(x.size(0)):
            X = ws.get("X", tuple(x.shape[1:]), dtype, x.device)
            X.copy_(x[k])
            run(X.mT if tall else X, out[k].mT if tall else out[k], False)
    else:
        X = x.to(dtype, memory_format=torch.contiguous_format, copy=True)
        run(X.mT if tall else X, out.mT if tall else out, batched or x.ndim == 3)
    return out
