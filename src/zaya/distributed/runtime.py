"""The runtime: process group, device, device mesh, and every collective the training code issues.

A plain ``zaya train`` is one process with no process group; under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT set) the group starts with the backend the device needs: NCCL on CUDA (RCCL on ROCm answers to
the same name), gloo on CPU. Start-up uses a short timeout (a rank that never arrives should fail fast); training
collectives use a long one (ZAYA1 raised it so that short network stalls don't kill a job).

**Mesh.** The ranks form a named device mesh ``("dp", "cp")``: data parallel (DDP / ZeRO-1 / FSDP2 replicate or
shard over "dp", and the data loader splits batches by the dp rank) and context parallel (ranks of one "cp" group
share a batch and split its sequence: ``zaya.distributed.context_parallel``). Ranks are laid out cp-fastest, so a cp
group sits on consecutive ranks, inside a node. Parameters are replicated (or sharded) over both dimensions: the
gradient reduction spans the whole world (``grad_group``, ``grad_mesh``), since every rank holds different tokens.

**Collectives.** The trainer's collectives go through ``Runtime`` and take tensors on the runtime's device: an
NCCL group has no CPU backend, so a scalar built on the CPU would fail there ("No backend type associated with
device type cpu"). Every collective checks its tensor's device, always. Work that must not share the training
group (a checkpoint written in the background) gets a ``HostGroup`` of its own: gloo, CPU tensors only.
``ZAYA_STRICT_DEVICES=1`` (tests) additionally makes any tensor that zaya's own code creates without naming its
device an error (``zaya.distributed.checks``), which is how a CPU test catches what would break on a GPU.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zaya.core.device import resolve_device
from zaya.core.errors import CollectiveError, ConfigError

STRICT_ENV = "ZAYA_STRICT_DEVICES"
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _check_device(tensor: torch.Tensor, device: torch.device, what: str) -> None:
    if tensor.device != device:
        raise RuntimeError(f"{what}: the tensor is on {tensor.device}, but this group's collectives run on {device} "
                           "(create it with device=runtime.device; a CPU scalar fails on an NCCL group)")


class HostGroup:
    """A gloo process group of its own, for collectives on CPU tensors and Python objects that must not interleave
    with training's (a background checkpoint's). Local no-ops in a single process."""

    def __init__(self, pg: Any, rank: int, world_size: int):
        self.pg, self.rank, self.world_size = pg, rank, world_size

    @property
    def distributed(self) -> bool:
        return self.pg is not None

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any."""
        if self.pg is None:
            return bool(flag)
        t = torch.tensor([int(flag)], device="cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(t.item())

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        _check_device(tensor, torch.device("cpu"), "host group all_reduce")
        if self.pg is not None:
            dist.all_reduce(tensor, op=_OPS[op], group=self.pg)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        _check_device(tensor, torch.device("cpu"), "host group broadcast")
        if self.pg is not None:
            dist.broadcast(tensor, src=src, group=self.pg)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.pg is not None:
            dist.barrier(group=self.pg)


@dataclass
class Runtime:
    """This process's place in the job; see the module docstring."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    distributed: bool = False
    mesh: Any = None
    """``DeviceMesh`` with dims ("dp", "cp") when distributed, else None."""
    local_world_size: int = 1
    strict: bool = False
    """Strict device mode (``ZAYA_STRICT_DEVICES=1``): see ``zaya.distributed.checks.ExplicitDevices``."""
    timeout_s: float = 1800.0
    hostname: str = field(default_factory=socket.gethostname)

    # --- where this rank sits ------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """The first rank of this node (node-local work: preparing node-local data, the RAM tier)."""
        return self.local_rank == 0

    def __post_init__(self) -> None:
        # The mesh's dimensions, looked up once: indexing a DeviceMesh builds a sub-mesh (host work and reads).
        self._dims: dict[str, Any] = {}
        if self.mesh is not None:
            self._dims = {name: self.mesh[name] for name in self.mesh.mesh_dim_names}
        self._sizes = {name: (m.size(), m.get_local_rank(), m.get_group()) for name, m in self._dims.items()}
        self._grad_mesh = None
        if self.mesh is not None:
            # One 1-D mesh over every rank for FSDP2 (collective: every rank builds its runtime at start-up).
            self._grad_mesh = self._dims["dp"] if self.cp_size == 1 else self.mesh._flatten("dp_cp")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (the world when no mesh was built: one process, or a hand-made Runtime)."""
        return self._sizes["dp"][0] if self._sizes else self.world_size

    @property
    def dp_rank(self) -> int:
        return self._sizes["dp"][1] if self._sizes else self.rank

    @property
    def cp_size(self) -> int:
        return self._sizes["cp"][0] if self._sizes else 1

    @property
    def cp_rank(self) -> int:
        return self._sizes["cp"][1] if self._sizes else 0

    @property
    def cp_group(self) -> Any:
        """The context-parallel process group (None without a mesh)."""
        return self._sizes["cp"][2] if self._sizes else None

    @property
    def grad_mesh(self) -> Any:
        """The 1-D mesh over which parameters are replicated or sharded and gradients averaged: every rank (dp x
        cp); the dp mesh itself when cp = 1. None without a mesh."""
        return self._grad_mesh

    @property
    def grad_group(self) -> Any:
        """The process group of ``grad_mesh`` (None: the world, or no process group)."""
        return None if self._grad_mesh is None else self._grad_mesh.get_group()

    @property
    def grad_size(self) -> int:
        return self.world_size

    @property
    def grad_rank(self) -> int:
        return self.rank

    def _group(self, over: str) -> Any:
        if over == "world":
            return None
        if over not in ("dp", "cp"):
            raise ValueError(f"unknown mesh dimension {over!r}; use 'world', 'dp' or 'cp'")
        return self._sizes[over][2] if self._sizes else None

    # --- collectives on the runtime's device ---------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", over: str = "world") -> torch.Tensor:
        """In place over the world (or one mesh dimension); returns ``tensor``."""
        _check_device(tensor, self.device, f"all_reduce({op}, {over})")
        if self.distributed:
            dist.all_reduce(tensor, op=_OPS[op], group=self._group(over))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        _check_device(tensor, self.device, "broadcast")
        if self.distributed:
            dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=self.device if self.device.type != "cpu" else None)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective: if any rank failed (``error`` on that rank), raise on every rank, so that none waits in a
        later collective for a rank that has given up. The failing rank raises its own error; the others an error
        with the same exit code that names it."""
        from zaya.core.errors import error_for_code, exit_code_of

        if not self.distributed:
            if error is not None:
                raise error
            return
        mine = None if error is None else (exit_code_of(error), f"{type(error).__name__}: {error}")
        rows = self.all_gather_object((self.rank, self.hostname, mine))
        if error is not None:
            raise error
        failed = [(r, h, m) for r, h, m in rows if m is not None]
        if failed:
            rank, host, (code, message) = failed[0]
            others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
            raise error_for_code(code, f"rank {rank} on {host} failed during {what}{others}: {message}")

    def host_group(self) -> HostGroup:
        """A new gloo group for work that must not share the training group (collective: every rank calls it)."""
        pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)) \
            if self.distributed else None
        return HostGroup(pg, self.rank, self.world_size)

    # --- host <-> device ----------------------------------------------------------------------------------
    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runtime's device without a host sync: pinned, copied asynchronously on a GPU."""
        if self.device.type == "cpu":
            return tensor
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def scalars(self, values: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Host numbers as one device tensor (no host sync: a pinned buffer copied asynchronously)."""
        return self.to_device(torch.tensor(values, dtype=dtype, device="cpu"))

    @staticmethod
    def read(tensor: torch.Tensor) -> list:
        """The host read of a step: the device values as Python numbers (waits for the device). A step calls it
        once, for the scalars it logs and decides on."""
        return tensor.tolist()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start(timeout_s: float = 1800.0, startup_timeout_s: float = 300.0, device: str = "auto",
          cp_size: int = 1) -> Runtime:
    """Start (or join) the process group as the environment says and build the mesh; a single process gets none."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = resolve_device(device, local_rank, what="train.device")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    strict = os.environ.get(STRICT_ENV, "") not in ("", "0")
    if not dist.is_initialized() and (not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1):
        if cp_size != 1:
            raise ConfigError(f"train.context_parallel = {cp_size} needs a multiple of {cp_size} processes and this "
                              f"is one: launch with torchrun --nproc-per-node {cp_size} (or a multiple of it), or "
                              f"pass --set train.context_parallel=1")
        return Runtime(device=dev, strict=strict, timeout_s=timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=startup_timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
        try:
            dist.barrier(device_ids=[dev.index] if dev.type == "cuda" else None)  # all arrived in time
        except Exception as exc:
            raise collective_error(exc, startup_timeout_s, "start-up") or exc
        _set_timeout(timeout_s)
    world = dist.get_world_size()
    if world % cp_size:
        fits = [n for n in range(1, world + 1) if world % n == 0]
        raise ConfigError(f"train.context_parallel = {cp_size} does not divide the world size {world}: launch a "
                          f"multiple of {cp_size} processes (torchrun --nproc-per-node), or pass "
                          f"--set train.context_parallel=N with N one of {fits}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
    return Runtime(rank=dist.get_rank(), world_size=world, local_rank=local_rank, device=dev,
                   distributed=world > 1, mesh=mesh if world > 1 else None,
                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strict=strict, timeout_s=timeout_s)


def _set_timeout(timeout_s: float) -> None:
    """Raise the default group's collective timeout after start-up (a private API; skipped where absent)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=timeout_s), _get_default_group())
    except Exception:  # pragma: no cover - older/newer torch without the hook keeps the start-up timeout
        pass


def stop(runtime: Runtime) -> None:
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


_LOST_PEER = re.compile(r"timed? ?out|timeout|connection (closed|reset|refused)|broken pipe|peer|"
                        r"socket|nccl error|remote process exited|no route to host", re.IGNORECASE)


def collective_error(exc: BaseException, timeout_s: float, during: str = "training") -> CollectiveError | None:
    """A ``CollectiveError`` (exit code 6) for an exception that says a collective timed out or a peer went away;
    None for anything else (which stays what it is)."""
    if isinstance(exc, CollectiveError):
        return exc
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and _LOST_PEER.search(str(exc))):
        return CollectiveError(
            f"a collective failed during {during} ({type(exc).__name__}: {text}): another rank died, hung, or "
            f"could not be reached for {timeout_s:g} s. Check the other ranks' logs; resume from the newest "
            "checkpoint once every node is healthy")
    return None
