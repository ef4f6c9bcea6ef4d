"""The shared multi-process test helper: run a function on N gloo ranks on 127.0.0.1 and collect what each rank
returned or raised.

Each rank gets the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free port), so ``zaya.distributed.runtime.start()`` joins the group as it would under
torchrun; one intra-op thread per rank (the ranks share the machine's cores).
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None
    """``Type: message`` and the traceback, when the rank raised."""
    exit_code: int | None = None
    """``zaya.core.errors.exit_code_of`` of what the rank raised."""


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any, env: dict) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", **env})
    import torch
    import torch.distributed as dist

    from zaya.core.errors import exit_code_of

    torch.set_num_threads(1)
    try:
        results[rank] = RankResult(rank, value=fn(rank, world, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results[rank] = RankResult(rank, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                                   exit_code=exit_code_of(exc))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int = 2, *args: Any, env: dict[str, str] | None = None,
              timeout_s: float = 240.0) -> list[RankResult]:
    """``fn(rank, world, *args)`` on ``world`` processes (a module-level function: it is pickled by name); their
    results in rank order. Every rank runs to its end (one that dies does not take the others down: a test may
    kill a rank on purpose); a rank that exits without reporting, or outlives ``timeout_s``, gets an error."""
    import time

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results, env or {}), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                results.setdefault(r, RankResult(r, error=f"still running after {timeout_s:g} s; killed"))
            results.setdefault(r, RankResult(r, error=f"exited with code {p.exitcode} without a result"))
        return [results[r] for r in range(world)]
