"""Process-group start-up from torchrun's environment, device choice, and small rank helpers.

A plain ``zaya train`` is one process with no process group; under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT set) the group starts with the backend the device needs: NCCL on CUDA (RCCL on ROCm answers to
the same name), gloo on CPU. Start-up uses a short timeout (a rank that never arrives should fail fast); training
collectives use a long one (ZAYA1 raised it so short network stalls don't kill a job).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def broadcast_object(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start(timeout_s: float = 1800.0, startup_timeout_s: float = 300.0) -> Runtime:
    """Start (or join) the process group as the environment says; a single process gets none."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cpu")
    if not dist.is_initialized():
        if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
            return Runtime(0, 1, 0, device, False)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=startup_timeout_s),
                                device_id=device if device.type == "cuda" else None)
        dist.barrier()  # every rank has arrived within the start-up timeout
        _set_timeout(timeout_s)
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_world_size() > 1)


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
