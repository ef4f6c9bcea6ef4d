"""The units of work of one Muon step, shared by the optimizer (``zaya.optim.muon``) and its communication
(``zaya.optim.muon_distributed``): a parameter's update (``Entry``), one matrix to orthogonalise (``Task``), the
step's deferred drift checks (``StepChecks``), and what the communication needs of the optimizer (``Runner``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from zaya.optim.newton_schulz import NSConfig

try:  # DTensor is only available in builds with torch.distributed
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


@dataclass
class Entry:
    """One parameter with a gradient this step, after the momentum update (local tensors for DTensors)."""

    param: Tensor
    p_local: Tensor
    grad: Tensor
    buf: Tensor
    nesterov: bool
    momentum: float
    cfg: NSConfig
    decay: float
    adjusted_lr: float

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.param.shape[-2:])  # type: ignore[return-value]

    def matrices(self) -> list[int | None]:
        """Index of each local matrix: ``[None]`` for a 2-D parameter, the local experts of a 3-D one."""
        return [None] if self.p_local.ndim == 2 else list(range(self.p_local.size(0)))

    def fill(self, dst: Tensor, index: int | None = None) -> None:
        """Write the update ``U`` of local matrix ``index`` into ``dst`` (casting). Reads only the gradient and
        the momentum buffer, so it gives the same ``U`` again after the parameter was updated."""
        g, b = self.grad, self.buf
        if index is not None:
            g, b = g[index], b[index]
        if self.nesterov:
            torch.lerp(g, b, self.momentum, out=dst)
        else:
            dst.copy_(b)

    def apply(self, ortho: Tensor, index: int | None = None) -> None:
        """``p <- p * decay - adjusted_lr * O`` (local matrix ``index``, or the local rows the caller holds)."""
        p = self.p_local if index is None else self.p_local[index]
        p.mul_(self.decay)
        p.add_(ortho, alpha=-self.adjusted_lr)

    def correct(self, delta: Tensor, index: int | None = None) -> None:
        """Replace an applied Gram result by the standard one: ``p += adjusted_lr * (O_gram - O_standard)``."""
        p = self.p_local if index is None else self.p_local[index]
        p.add_(delta, alpha=self.adjusted_lr)


def _ignore(_: Tensor) -> None:
    pass


@dataclass
class Task:
    """One matrix to orthogonalise: ``fill(dst)`` writes its update, ``sink(O)`` consumes the result.

    ``flag(f)`` receives the drift check of a Gram result (a 1-element bool device tensor, not read); in a
    correction run (``Muon._run(tasks, fix=...)``) ``fix(delta)`` receives ``O_gram - O_standard`` in float32.
    """

    m0: int
    n0: int
    cfg: NSConfig
    device: torch.device
    fill: Callable[[Tensor], None]
    sink: Callable[[Tensor], None]
    param_dtype: torch.dtype
    flag: Callable[[Tensor], None] = _ignore
    fix: Callable[[Tensor], None] = _ignore


class StepChecks:
    """The drift checks of one step, kept on the device and read together at its end (one host read per device).

    ``add(flags, resolve)`` registers device tensors (any shape; their elements concatenated in order) and a
    callback that gets their values as a list of bools. Callbacks run in registration order, which is the same on
    every rank, so a callback may issue collectives provided its decision depends only on values every rank of the
    collective has.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[list[Tensor], Callable[[list[bool]], None]]] = []

    def add(self, flags: Sequence[Tensor], resolve: Callable[[list[bool]], None]) -> None:
        if flags:
            self.pending.append((list(flags), resolve))

    def resolve(self) -> None:
        pending, self.pending = self.pending, []
        if not pending:
            return
        by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
        for flags, _ in pending:
            for f in flags:
                by_device[f.device].append(f.reshape(-1).to(torch.bool))
        values = {d: iter(torch.cat(fs).tolist()) for d, fs in by_device.items()}  # the host read
        for flags, resolve in pending:
            resolve([bool(next(values[f.device])) for f in flags for _ in range(f.numel())])


class Runner(Protocol):
    """The optimizer as the communication drives it: orthogonalise tasks (all, or again only those in ``fix``),
    and run a rank's own experts' tasks."""

    def _run(self, tasks: list[Task], fix: set[int] | None = None) -> None: ...

    def _local_tasks(self, entries: list[Entry]) -> list[Task]: ...

    def _run_local(self, tasks: list[Task], checks: StepChecks) -> None: ...
