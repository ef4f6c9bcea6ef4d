"""CPU-side checks for what would go wrong on a GPU: tensors created without a device, and host reads.

On a CPU machine every tensor is on the CPU, so a scalar built with ``torch.tensor([...])`` and handed to an NCCL
collective, or a ``.item()`` that would stall a GPU stream, goes unnoticed. These two modes make both visible:

* ``ExplicitDevices``: while active, a tensor factory (``torch.tensor``, ``zeros``, ``arange``, ...) called from
  zaya's own source without ``device=`` raises, naming the file and line. Under ``ZAYA_STRICT_DEVICES=1`` the
  trainer runs with it, so a CPU test fails where a GPU run would have put the tensor on the wrong device.
* ``HostReads``: counts the operations that copy a device value to the host and wait for it (``.item()``,
  ``float()``/``int()``/``bool()`` of a tensor, ``.tolist()``, ``.cpu()``, ``.numpy()``, and at the dispatcher
  ``aten._local_scalar_dense``), plus the ops whose output size depends on the data, which a GPU can only size by
  reading a count back (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``bincount``,
  ``repeat_interleave`` without ``output_size``). Each event is recorded once, with the zaya source line that
  caused it.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../src/zaya


def _zaya_caller(depth: int = 2) -> str | None:
    """``file:line`` of the nearest calling frame inside zaya's package (skipping this module), or None."""
    frame = sys._getframe(depth)
    here = __file__
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE) and name != here:
            return f"{Path(name).relative_to(Path(_PACKAGE).parent)}:{frame.f_lineno}"
        if "torch" not in name and not name.startswith(_PACKAGE):
            return None  # the call came from user code (a test, a script): not zaya's to answer for
        frame = frame.f_back
    return None


def _direct_zaya_caller() -> str | None:
    """``file:line`` when the frame that called the torch function is zaya's own code, else None."""
    frame = sys._getframe(2)
    name = frame.f_code.co_filename
    if name.startswith(_PACKAGE) and name != __file__:
        return f"{Path(name).relative_to(Path(_PACKAGE).parent)}:{frame.f_lineno}"
    return None


def _factories() -> set:
    from torch.utils._device import _device_constructors

    return set(_device_constructors())


class ExplicitDevices(TorchFunctionMode):
    """Raise when zaya code creates a tensor without saying where it lives (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._factories = _factories()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._factories and kwargs.get("device") is None:
            where = _direct_zaya_caller()
            if where is not None:
                raise RuntimeError(
                    f"{where}: torch.{func.__name__}(...) without device= (strict device mode): on a GPU this "
                    "tensor would land on the CPU. Pass device=runtime.device (or device=\"cpu\" for host data)")
        return func(*args, **kwargs)


_HOST_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}
_DISPATCH_READS = {"_local_scalar_dense"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
                   "bincount", "argwhere", "nonzero_numpy"}


class _FunctionSide(TorchFunctionMode):
    def __init__(self, owner: "HostReads"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_METHODS and args and isinstance(args[0], torch.Tensor):
            if self.owner._depth == 0:
                self.owner._record(f"Tensor.{name}", _zaya_caller(2))
            self.owner._depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.owner._depth -= 1
        return func(*args, **kwargs)


class _DispatchSide(TorchDispatchMode):
    def __init__(self, owner: "HostReads"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if self.owner._depth == 0 and threading.get_ident() == self.owner._thread:
            if name in _DISPATCH_READS or name in _DATA_DEPENDENT:
                self.owner._record(f"aten.{name}", _zaya_caller(2))
            elif name in ("index", "index_put", "index_put_") and _has_bool_index(args):
                self.owner._record(f"aten.{name} (boolean mask)", _zaya_caller(2))
            elif name == "repeat_interleave" and "output_size" not in kwargs and len(args) >= 1 \
                    and isinstance(args[0], torch.Tensor) and len(args) < 3:
                self.owner._record("aten.repeat_interleave (no output_size)", _zaya_caller(2))
        return func(*args, **kwargs)


def _has_bool_index(args: tuple) -> bool:
    if len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


class HostReads:
    """Context manager counting host reads in this thread (see the module docstring)::

        with HostReads() as reads:
            trainer.step()
        assert reads.total <= 1, reads.report()
    """

    def __init__(self) -> None:
        self.events: Counter[tuple[str, str]] = Counter()
        self._depth = 0
        self._thread = threading.get_ident()
        self._function = _FunctionSide(self)
        self._dispatch = _DispatchSide(self)

    def _record(self, what: str, where: str | None) -> None:
        self.events[(what, where or "outside zaya")] += 1

    @property
    def total(self) -> int:
        return sum(self.events.values())

    def by_place(self) -> dict[str, int]:
        return {f"{what} at {where}": n for (what, where), n in self.events.most_common()}

    def report(self) -> str:
        return "; ".join(f"{n} x {place}" for place, n in self.by_place().items()) or "no host reads"

    def __enter__(self) -> "HostReads":
        self._thread = threading.get_ident()
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)
