"""Muon: momentum + Newton-Schulz orthogonalised updates for matrix parameters; fast, expert-aware, distributed.

The constructor and the update rule are those of :class:`torch.optim.Muon` (torch 2.13), so settings and
checkpoints carry over. On top of it: stacked 3-D expert parameters ``[E, out, in]`` (each expert orthogonalised
on its own, its lr adjusted for its own shape), a faster Newton-Schulz (``ns_method``, ``zaya.optim.newton_schulz``),
``ns_dtype`` and ``ns_coefficients``, and distributed work splitting (``distributed``, ``replica_group``: each
matrix orthogonalised by one rank, ``zaya.optim.muon_distributed``). This module holds the parameter groups, the
update rule, checkpoints, and running this rank's matrices through NS; a step reads the device at most once (the
Gram drift checks, all at its end). With a DTensor on a mesh of more than one rank, or a ``replica_group`` of more
than one, ``step()`` is collective. The update, the momentum form, weight decay, the lr adjustment and the
distributed modes: docs/training.md, "Muon and Newton-Schulz".
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from zaya.core.device import dtype_name, to_dtype
from zaya.optim import muon_distributed as md
from zaya.optim.muon_work import Entry, StepChecks, Task, is_dtensor, local
from zaya.optim.newton_schulz import (
    BATCH_ELEMENTS,
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_GRAM_RESTARTS,
    DEFAULT_NS_STEPS,
    EPS,
    NS_DTYPES,
    NS_METHODS,
    NSConfig,
    Workspace,
    check_coefficients,
    freeze_coefficients,
    iteration_coefficients,
    orthogonalize_,
    stacked,
    standard_,
    zeropower_via_newtonschulz,
)

try:  # DTensor is only available in builds with torch.distributed
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    Shard = None  # type: ignore[assignment,misc]

__all__ = ["Muon"]

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
DISTRIBUTED_MODES = ("auto", "local")


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


def _dtype_name(dtype: Any) -> str:
    """"bfloat16" or "float32" from a torch.dtype or its name; anything else is refused."""
    try:
        found = to_dtype(dtype)
    except ValueError:
        found = None
    if found not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    return dtype_name(found)


class Muon(Optimizer):
    """Muon for 2-D and stacked 3-D ``[E, out, in]`` parameters, plain tensors or DTensors (see module docstring).

    Args mirror :class:`torch.optim.Muon` (``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
    ``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``), plus ``ns_dtype`` (``torch.bfloat16`` or
    ``torch.float32``: the dtype of the Newton-Schulz iteration), ``ns_method`` (``"auto"``, ``"standard"``,
    ``"gram"`` or ``"reference"``), ``gram_restarts`` (iterations at which the Gram iteration restarts),
    ``distributed`` (``"auto"`` or ``"local"``) and ``replica_group`` (a process group over which every rank holds
    the same plain-tensor parameters, i.e. DDP's data-parallel group; ``None``: parameters are not replicated, or
    one process). ``ns_coefficients`` may also be a sequence of triples (one per iteration) or
    ``"polar_express"``. All but ``distributed`` and ``replica_group`` can be set per parameter group.
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
        replica_group: Any = None,
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
        self.replica_group = replica_group
        self.gram_fallbacks = 0  # Gram results that failed the drift check and were recomputed (diagnostics)
        self.ns_matrices = 0  # matrices this rank orthogonalised in the last step (diagnostics)
        self._ws = Workspace()
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # also runs at the end of load_state_dict
        for group in self.param_groups:  # groups saved by an older version lack the newer options
            for key in ("ns_method", "gram_restarts"):
                group.setdefault(key, self.defaults.get(key, "auto" if key == "ns_method" else
                                                        DEFAULT_GRAM_RESTARTS))
        if self.__dict__.get("distributed") not in DISTRIBUTED_MODES:  # absent, or an older version's "owner"
            self.__dict__["distributed"] = "auto"
        self.__dict__.pop("process_group", None)
        self.__dict__.setdefault("replica_group", None)
        self.__dict__.setdefault("gram_fallbacks", 0)
        self.__dict__.setdefault("ns_matrices", 0)
        self.__dict__.setdefault("_ws", Workspace())

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
        check_coefficients(param_group["ns_coefficients"])
        param_group["ns_coefficients"] = freeze_coefficients(param_group["ns_coefficients"])
        param_group["gram_restarts"] = tuple(int(i) for i in param_group["gram_restarts"])
        param_group["params"] = params
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimisation step (collective over ranks: see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries: list[Entry] = []
        self.ns_matrices = 0
        for group in self.param_groups:
            lr = group["lr"]
            lr = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
            cfg = NSConfig(iteration_coefficients(group["ns_coefficients"], group["ns_steps"]), float(group["eps"]),
                           to_dtype(_dtype_name(group["ns_dtype"])), group["ns_method"],
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
                g_local, buf_local = local(grad), local(buf)
                buf_local.lerp_(g_local, 1 - momentum)
                entries.append(Entry(p, local(p), g_local, buf_local, group["nesterov"], momentum, cfg,
                                     1 - lr * group["weight_decay"],
                                     _adjust_lr(lr, group["adjust_lr_fn"], tuple(p.shape[-2:]))))
        self._update(entries)
        return loss

    def _update(self, entries: list[Entry]) -> None:
        local_entries: list[Entry] = []
        gathered: list[Entry] = []
        sharded: dict[Any, list[Entry]] = {}
        replicated: list[Entry] = []
        group = self._replicas()
        for e in entries:
            if is_dtensor(e.param):
                mesh = e.param.device_mesh
                if mesh.size() == 1:
                    local_entries.append(e)
                elif self.distributed != "local" and mesh.ndim == 1 and tuple(e.param.placements) == (Shard(0),):
                    sharded.setdefault(mesh, []).append(e)
                else:
                    gathered.append(e)
            elif group is not None:
                replicated.append(e)
            else:
                local_entries.append(e)
        checks = StepChecks()
        # Same order on every rank: the collectives of each part are issued in entry order, and the checks'
        # corrections (some collective) in the order the parts registered them.
        if gathered:
            md.update_gathered(self, gathered, checks)
        for mesh, part in sharded.items():
            md.update_sharded(self, mesh, part, checks)
        if replicated:
            md.update_replicated(self, replicated, group, checks)
        if local_entries:
            self._run_local(self._local_tasks(local_entries), checks)
        checks.resolve()

    def _replicas(self) -> Any:
        """``replica_group`` when plain tensors are to be split over it (``"auto"``, more than one rank)."""
        group = self.replica_group
        if self.distributed == "local" or group is None:
            return None
        return group if dist.get_world_size(group) > 1 else None

    # --- execution on this rank -------------------------------------------------------------------------------

    def _run(self, tasks: list[Task], fix: set[int] | None = None) -> None:
        """Orthogonalise every task: big CPU matrices one at a time, the rest stacked by shape (``stacked``).

        With ``fix`` (indices into ``tasks``: flagged Gram results), run again, on the same list, only the runs
        that hold a flagged task: the grouping depends only on the list, so every run is the same stack as before
        and recomputes the same ``O_gram``; each flagged task gets ``fix(O_gram - O_standard)``.
        """
        batches: dict[tuple, list[tuple[int, Task]]] = defaultdict(list)
        if fix is None:
            self.ns_matrices += len(tasks)
        for i, t in enumerate(tasks):
            if t.cfg.method == "reference":
                if fix is None:
                    self._run_reference(t)
            elif not stacked(t.m0, t.n0, t.device):
                if fix is None or i in fix:
                    self._run_group([(i, t)], t.m0, t.n0, t.cfg, t.device, False, fix)
            else:
                batches[(t.m0, t.n0, t.cfg, t.device)].append((i, t))
        for (m0, n0, cfg, device), its in batches.items():
            per = max(1, BATCH_ELEMENTS // (m0 * n0))
            for s in range(0, len(its), per):
                chunk = its[s:s + per]
                if fix is None or any(i in fix for i, _ in chunk):
                    self._run_group(chunk, m0, n0, cfg, device, True, fix)

    def _run_reference(self, t: Task) -> None:
        u = self._ws.get("U", (t.m0, t.n0), t.param_dtype, t.device)
        t.fill(u)
        t.sink(zeropower_via_newtonschulz(u, t.cfg.coeffs, len(t.cfg.coeffs), t.cfg.eps, t.cfg.dtype))

    # Input and output buffers keep the parameter's layout; a tall matrix is iterated on as their transposed
    # views (matmuls take transposed operands and write transposed outputs at full speed). Filling or reading a
    # contiguous transposed copy instead costs an extra strided pass: 38 ms instead of 17 ms for the Nesterov
    # lerp + cast of one 4096x2048 expert, measured.

    def _run_group(self, its: list[tuple[int, Task]], m0: int, n0: int, cfg: NSConfig, device: torch.device,
                   batched: bool, fix: set[int] | None) -> None:
        """One matrix (``batched=False``, in the reused workspace) or one stack of same-shape matrices."""
        tall = m0 > n0
        ws = Workspace() if batched else self._ws  # stacks vary in size: free them with the batch
        shape = (len(its), m0, n0) if batched else (m0, n0)
        X = ws.get("X", shape, cfg.dtype, device)
        for k, (_, t) in enumerate(its):
            t.fill(X[k] if batched else X)  # the Nesterov update, cast, in one pass
        out = ws.get("O", shape, cfg.dtype, device)
        Xv, outv = (X.mT, out.mT) if tall else (X, out)
        flags = orthogonalize_(Xv, outv, cfg, ws, batched)
        if fix is None:
            if flags is not None:
                flags = flags.reshape(-1)
                for k, (_, t) in enumerate(its):
                    t.flag(flags[k:k + 1])
            for k, (_, t) in enumerate(its):
                t.sink(out[k] if batched else out)
            return
        std = torch.empty_like(out)
        standard_(Xv, std.mT if tall else std, cfg, ws, batched)
        for k, (i, t) in enumerate(its):
            if i in fix:
                o, s = (out[k], std[k]) if batched else (out, std)
                t.fix(o.float() - s.float())

    def _local_tasks(self, entries: list[Entry]) -> list[Task]:
        tasks = []
        for e in entries:
            m0, n0 = e.shape
            for i in e.matrices():
                tasks.append(Task(m0, n0, e.cfg, e.p_local.device, functools.partial(e.fill, index=i),
                                  functools.partial(e.apply, index=i), e.grad.dtype,
                                  fix=functools.partial(e.correct, index=i)))
        return tasks

    def _run_local(self, tasks: list[Task], checks: StepChecks) -> None:
        """Run tasks whose results this rank applies itself; their checks' corrections are local too."""
        flagged: list[tuple[int, Tensor]] = []
        for i, t in enumerate(tasks):
            t.flag = functools.partial(lambda i, f: flagged.append((i, f)), i)
        self._run(tasks)
        ids = [i for i, _ in flagged]

        def resolve(bad: list[bool]) -> None:
            fix = {i for i, b in zip(ids, bad) if b}
            if fix:
                self._run(tasks, fix)
                self.gram_fallbacks += len(fix)

        checks.add([f for _, f in flagged], resolve)
