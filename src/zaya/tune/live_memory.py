"""Peak bytes of live tensor storage on a device, measured on any backend: the CPU's stand-in for
``torch.cuda.max_memory_allocated``, used to check ``zaya plan``'s memory model against real runs.

The CPU allocator keeps no statistics, and the process's resident size mixes the interpreter, libraries and
allocator caching with the tensors. ``LiveMemory`` counts what the planner models instead: every storage a
tensor op creates while it is active, from creation until the storage is freed, deduplicated (views share their
storage), with storage resizes (FSDP2 frees and re-creates its all-gathered parameters that way) followed. It is a
``TorchDispatchMode``, so it sees every operator the thread dispatches, including those C++ code issues (DDP's
gradient buckets, autograd's saved tensors); it does not see tensors made on other threads (the data loader's
prefetched batches, a few bytes per token) or memory outside tensors. Enter it before the model is built so that
the parameters, gradients and optimizer state count too. Overhead: a few microseconds per operator.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s memory (a DTensor's local shard), or None for tensors without storage."""
    inner = getattr(t, "_local_tensor", None)
    if inner is not None:
        return inner
    if type(t) is not torch.Tensor and not isinstance(t, (torch.nn.Parameter, FakeTensor)):
        return None  # another wrapper subclass: its inner tensors were created by ops this mode saw
    if t.layout != torch.strided:
        return None
    return t


class LiveMemory(TorchDispatchMode):
    """``with LiveMemory("cpu") as mem: ...``; then ``mem.peak`` (bytes), ``mem.current``, ``mem.reset_peak()``."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._resize = None

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (the ``torch.cuda.reset_peak_memory_stats`` analogue)."""
        self.peak = self.current

    # --- bookkeeping -----------------------------------------------------------------------------------------
    def _set(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        size = storage.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            old = 0
        self._sizes[key] = size
        self.current += size - old
        if self.current > self.peak:
            self.peak = self.current

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = _local(t)
        if local is None or local.device.type != self.device_type:
            return
        self._set(local.untyped_storage())

    # --- the mode ----------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func._schema.is_mutable:  # in-place ops (resize_, set_, out= variants) may change an input's storage
            for t in inputs:
                self._track(t)
        # A view of an input (or an in-place op's result) is no new memory, even when the input's storage was
        # made before this mode began (parameters viewed by a transpose).
        seen = {key for key in map(self._key, inputs) if key is not None}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and self._key(t) not in seen:
                self._track(t)
        return out

    def _key(self, t: torch.Tensor) -> int | None:
        local = _local(t)
        return None if local is None else local.untyped_storage()._cdata

    def __enter__(self) -> "LiveMemory":
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int):
            result = original(storage, size)
            if storage.device.type == tracker.device_type:
                tracker._set(storage)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)
