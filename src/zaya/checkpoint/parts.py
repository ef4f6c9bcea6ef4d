"""The model and the optimizers as stateful parts of a checkpoint (see ``zaya.checkpoint.store``).

A *part* is any object with ``state_dict()`` and ``load_state_dict(state)``; the store saves a dictionary of named
parts, so a new kind of state registers itself by adding a part. These two wrap
``torch.distributed.checkpoint.state_dict``, whose keys are fully qualified parameter names whatever the wrapper
(DDP, ZeRO-1's subsets, FSDP2's DTensor shards), so a checkpoint loads at another world size or parallel mode. Saved
under the names ``model`` and ``optim`` they give the DCP keys ``model.<fqn>`` and ``optim.state.<fqn>.<key>``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

__all__ = ["ModelState", "OptimizerState"]


class ModelState:
    """Parameters and persistent buffers of ``model`` (the bare model, or its DDP / FSDP2 wrapper), by name."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=StateDictOptions())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions())


class OptimizerState:
    """The per-parameter state of ``optimizers`` (Muon's momentum, AdamW's moments and steps), by parameter name:
    ``{"state": {fqn: {key: tensor}}}``.

    No ``param_groups``: under ZeRO-1 each rank's optimizer holds different parameters (rank 0's groups would be
    wrong on rank 1), and hyperparameters come from the config, not the file (the config may change on resume; a
    ``torch.dtype`` group option is not JSON). Loading takes the live optimizers' groups, hyperparameters included.

    A non-tensor value in a parameter's state (an optimizer that keeps ``step`` as a Python number) is saved as a
    0-d CPU tensor, so it is written by the rank that holds it (under ZeRO-1 only one rank does), and turned back
    into a number on load.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]):
        self.model = model
        self.optimizers = list(optimizers)

    def _live(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizers, options=StateDictOptions())

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizers:
            return {"state": {}}
        state = self._live()["state"]
        return {"state": {fqn: {key: _as_tensor(v) for key, v in per_param.items()}
                          for fqn, per_param in state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.optimizers:
            return
        live = self._live()
        loaded: dict[str, Any] = {}
        for fqn, per_param in state["state"].items():
            now = live["state"].get(fqn, {})
            loaded[fqn] = {key: _like(v, now.get(key)) for key, v in per_param.items()}
        # The live groups: their parameter names are this rank's, their hyperparameters the config's.
        set_optimizer_state_dict(self.model, self.optimizers, {"state": loaded, "param_groups": live["param_groups"]},
                                 options=StateDictOptions())


def _as_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        return torch.tensor(value, dtype=torch.bool, device="cpu")
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64, device="cpu")
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64, device="cpu")
    return value  # anything else stays what it is (the store writes it into meta.json, from rank 0)


def _like(loaded: Any, live: Any) -> Any:
    """``loaded`` in the type the live optimizer keeps: a Python number where it keeps one (see ``_as_tensor``)."""
    if isinstance(loaded, torch.Tensor) and isinstance(live, (bool, int, float)) and loaded.dim() == 0:
        return type(live)(loaded.item())
    return loaded


# --- a part's state: tensors for DCP, the rest for meta.json ------------------------------------------------------
class _Absent:
    """No value at this place (a tensor in the JSON tree, or a JSON value in the tensor tree)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def split_state(name: str, state: Any, check_json: bool = True) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """``(tensor tree, JSON tree, flat tensors)`` of part ``name``'s state (a nested dict).

    The tensor tree keeps the containers that lead to tensors (``ABSENT`` in lists where a JSON value was); the JSON
    tree keeps every other value (tuples as lists, ``None`` in lists where a tensor was; a dict that held only
    tensors is left out). The flat dict maps DCP's keys, ``<name>.<nested keys>``, to the same tensor objects as the
    tensor tree, so loading into it in place fills the tree. Raises TypeError for a value that is neither a tensor
    nor JSON (numbers, strings, bools, None, lists and dicts of them with string keys), unless ``check_json`` is
    false (a load, which needs only the tensors)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"checkpoint part {name!r}: state_dict() returned {type(state).__name__}, not a dict")
    flat: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: tuple) -> tuple[Any, Any]:
        if isinstance(value, torch.Tensor):
            key = ".".join((name, *map(str, path)))
            if key in flat:
                raise TypeError(f"checkpoint part {name!r}: two tensors are both named {key!r} once flattened")
            flat[key] = value
            return value, ABSENT
        if isinstance(value, Mapping):
            tensors, rest = {}, {}
            for k, v in value.items():
                if not isinstance(k, str) and check_json:
                    raise TypeError(f"checkpoint part {name!r}: key {k!r} at {_where(name, path)} is "
                                    f"{type(k).__name__}; state keys must be strings")
                t, r = walk(v, (*path, k))
                if t is not ABSENT:
                    tensors[k] = t
                if r is not ABSENT and not (r == {} and t is not ABSENT):
                    rest[k] = r
            return (tensors if tensors else ABSENT), rest
        if isinstance(value, (list, tuple)):
            pairs = [walk(v, (*path, i)) for i, v in enumerate(value)]
            tensors = [t for t, _ in pairs]
            rest = [None if r is ABSENT or (r == {} and t is not ABSENT) else r for t, r in pairs]
            return (tensors if any(t is not ABSENT for t in tensors) else ABSENT), rest
        return ABSENT, (_json_leaf(value, name, path) if check_json else value)

    tensors, rest = walk(state, ())
    return (tensors if tensors is not ABSENT else {}), rest, flat


def merge_state(rest: Any, tensors: Any) -> Any:
    """The inverse of ``split_state``: the JSON tree with the tensor tree's tensors put back in their places."""
    if tensors is ABSENT:
        return rest
    if isinstance(tensors, torch.Tensor):
        return tensors
    if isinstance(tensors, dict):
        base = rest if isinstance(rest, dict) else {}
        out = dict(base)
        for k, sub in tensors.items():
            out[k] = merge_state(base.get(k, ABSENT), sub)
        return out
    base = rest if isinstance(rest, list) else []
    out = list(base) + [None] * max(0, len(tensors) - len(base))
    for i, sub in enumerate(tensors):
        if sub is not ABSENT:
            out[i] = merge_state(base[i] if i < len(base) else ABSENT, sub)
    return out


def _where(name: str, path: tuple) -> str:
    return ".".join((name, *map(str, path)))


def _json_leaf(value: Any, name: str, path: tuple) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        import numpy as np

        if isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float, str)):
            return value.item()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"checkpoint part {name!r}: {_where(name, path)} is a {type(value).__name__}; a part's state "
                    "holds tensors and JSON values (numbers, strings, bools, None, lists and dicts of them)")
