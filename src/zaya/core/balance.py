"""One greedy assignment of work to ranks: largest first, each to the least-loaded rank.

Used wherever ranks split work among themselves without talking: Muon's matrices, ZeRO-1's parameters, a
checkpoint's replicated tensors and the files whose checksums are verified. Every rank computes the same answer from
the same inputs, so ties are broken by order, never by chance: among equal costs the smaller key goes first, among
equally loaded ranks the lower rank wins.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)


def balance(costs: Mapping[K, float], load: list[float], ranks: Mapping[K, Sequence[int]] | None = None
            ) -> dict[K, int]:
    """The owner of each key of ``costs``, in the order they were given out (largest cost first; ties: the smaller
    key). Each goes to the least-loaded of its ``ranks`` (every rank of ``load`` when None; ties: the lower rank).
    ``load`` is each rank's load before (updated in place)."""
    everyone = range(len(load))
    owner: dict[K, int] = {}
    for key in sorted(costs, key=lambda k: (-costs[k], k)):
        rank = min(everyone if ranks is None else ranks[key], key=lambda r: (load[r], r))
        owner[key] = rank
        load[rank] += costs[key]
    return owner


def assign(costs: Sequence[float], world: int, load: Sequence[float] | None = None) -> list[int]:
    """``balance`` for a list: the owner of each item by position (ties: the lower index), over ``world`` ranks
    starting from ``load`` (zero by default; not changed)."""
    owner = balance(dict(enumerate(costs)), list(load) if load is not None else [0.0] * world)
    return [owner[i] for i in range(len(costs))]
