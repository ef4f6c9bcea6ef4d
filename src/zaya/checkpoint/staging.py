"""Copies of a training state in host memory: what an async save writes while training changes the live tensors.

``stage`` copies every tensor of a nested state (dicts and lists, as ``get_state_dict`` returns them) into host
memory. A DTensor (FSDP2) stays a DTensor with the same mesh and placements, its local shard copied, which is what
``torch.distributed.checkpoint`` needs to write each rank's part. Buffers of the previous staging are reused when
the shapes still match, so a run pays the allocation (and, on Linux, the page faults) once, not at every save;
device-to-host copies go to pinned memory and run asynchronously until one synchronisation at the end.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def _host_copy(src: torch.Tensor, reuse: torch.Tensor | None) -> torch.Tensor:
    if (reuse is not None and reuse.shape == src.shape and reuse.dtype == src.dtype
            and reuse.device.type == "cpu" and reuse.is_contiguous()):
        dst = reuse
    else:
        dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.device.type == "cuda")
    dst.copy_(src.detach(), non_blocking=src.device.type == "cuda")
    return dst


def _stage(value: Any, reuse: Any) -> Any:
    if _is_dtensor(value):
        from torch.distributed.tensor import DTensor

        old_local = reuse.to_local() if _is_dtensor(reuse) else None
        local = _host_copy(value.to_local(), old_local)
        # The constructor, not DTensor.from_local: from_local moves the local tensor to the mesh's device, which
        # for a GPU mesh would copy the staged state straight back onto the GPU.
        return DTensor(local, value._spec, requires_grad=False)
    if isinstance(value, torch.Tensor):
        return _host_copy(value, reuse if isinstance(reuse, torch.Tensor) else None)
    if isinstance(value, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _stage(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        old = reuse if isinstance(reuse, type(value)) and len(reuse) == len(value) else [None] * len(value)
        return type(value)(_stage(v, o) for v, o in zip(value, old))
    return copy.deepcopy(value)


def stage(state: dict[str, Any], reuse: dict[str, Any] | None = None) -> dict[str, Any]:
    """A host-memory copy of ``state``, reusing ``reuse``'s buffers (a previous staging no longer in use)."""
    staged = _stage(state, reuse)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


def local_view(value: Any) -> Any:
    """The same nested state with every DTensor replaced by its local shard: what one rank holds."""
    if _is_dtensor(value):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local_view(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_view(v) for v in value)
    return value


def copy_into_live(saved: Any, live: Any) -> Any:
    """Copy ``saved`` (a ``local_view``, e.g. memory-mapped from a file) into the tensors of ``live`` (the live
    state dict, whose tensors are the model's parameters and the optimizer's state), in place, and return the
    state to hand to ``set_state_dict``: ``live``'s tensors where they took the data, ``saved``'s other values.

    Copying matters: a tensor handed over as it is would stay a copy-on-write mapping of the file, so the first
    optimizer step would fault on every page, and the file's memory could not be freed while the run lasts.
    """
    if isinstance(saved, torch.Tensor) and (_is_dtensor(live) or isinstance(live, torch.Tensor)):
        target = live.to_local() if _is_dtensor(live) else live
        if target.shape == saved.shape and target.dtype == saved.dtype:
            target.copy_(saved)
            return live
        return saved.clone()  # a mismatch that set_state_dict will report; never a mapping of the file
    if isinstance(live, dict) and isinstance(saved, dict):
        return {k: copy_into_live(v, live.get(k)) for k, v in saved.items()}
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        return type(saved)(copy_into_live(s, v) for s, v in zip(saved, live))
    if isinstance(saved, torch.Tensor):
        return saved.clone()
    return saved


def tensor_bytes(value: Any) -> int:
    """Bytes of this rank's tensors in a nested state (local shards for DTensors)."""
    if _is_dtensor(value):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0
