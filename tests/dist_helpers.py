"""The shared multi-process test helpers: ``free_port``, ``run_ranks``, which runs a function on N gloo ranks on
127.0.0.1 and collects what each rank returned or raised (``run_ok`` where every rank must succeed), and
``strict_step``, a rank's trainer steps under strict devices with the host reads counted.

Each rank gets the caller's environment and working directory plus what torchrun would give it (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), so
``zaya.distributed.runtime.start()`` joins the group as it would under torchrun; one intra-op thread per rank (the
ranks share the machine's cores). Ranks are forked from a server that imported torch, pytest, the zaya modules
the ranks run and what their first calls import lazily (``PRELOAD``) once per session: a rank starts in a tenth of
a second instead of importing them (seconds of CPU per rank on 2 cores).
"""

from __future__ import annotations

import os
import random
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zaya.core.errors import exit_code_of


PRELOAD = ["torch", "torch.distributed", "pytest", "zaya.core.errors", "zaya.train.trainer", "zaya.cli",
           "zaya.distributed.context_parallel", "zaya.serve.tree", "zaya.tune",
           # what the ranks' first FSDP2 wrap, DTensor, Muon and checkpoint calls import lazily (some 800 modules,
           # dynamo and sympy among them: 2-3 s of CPU in each rank otherwise)
           "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.elastic.multiprocessing.errors",
           "torch.utils.serialization", "zaya.optim.build", "zaya.distributed.parallel", "zaya.distributed.checks",
           "zaya.distributed.shared_fs", "zaya.checkpoint.store", "zaya.core.procs", "zaya.model.info",
           "zaya.eval.perplexity", "zaya.data.cache", "psutil", "numpy.random", "numpy.ma"]
"""Imported once by the fork server (none of them starts a thread at import, so forking after them is safe)."""


def free_port() -> int:
    """A port no socket holds now, chosen below the kernel's ephemeral range: a port from ``bind(0)`` is an
    ephemeral one, which a client connection made before the ranks listen may take as its own local port
    (EADDRINUSE at a TCPStore, seen once in a fresh-clone run)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    choose = random.Random()
    for _ in range(100):
        port = choose.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str, env: dict, cwd: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update({**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    try:
        result = RankResult(rank, value=fn(rank, world, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = RankResult(rank, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                            exit_code=exit_code_of(exc))
    path = os.path.join(out, str(rank))
    torch.save(result, path + ".part")
    os.replace(path + ".part", path)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is saved: skip the interpreter's teardown (a second or more per rank on 2 cores)


def run_ranks(fn: Callable, world: int = 2, *args: Any, env: dict[str, str] | None = None,
              timeout_s: float = 240.0) -> list[RankResult]:
    """``fn(rank, world, *args)`` on ``world`` processes (a module-level function: it is pickled by name); their
    results in rank order (saved with ``torch.save``: tensors come back whole). Every rank runs to its end (one
    that dies does not take the others down: a test may kill a rank on purpose); a rank that exits without
    reporting, or outlives ``timeout_s``, gets an error."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="zaya-ranks-") as out:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out, env, os.getcwd()), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                results.append(RankResult(r, error=f"still running after {timeout_s:g} s; killed"))
            elif not os.path.exists(os.path.join(out, str(r))):
                results.append(RankResult(r, error=f"exited with code {p.exitcode} without a result"))
            else:
                results.append(torch.load(os.path.join(out, str(r)), weights_only=False))
        return results


def run_ok(fn: Callable, world: int = 2, *args: Any, env: dict[str, str] | None = None,
           timeout_s: float = 240.0) -> list[Any]:
    """``run_ranks`` where every rank must succeed: their values in rank order; a rank's error fails the test with
    its traceback."""
    results = run_ranks(fn, world, *args, env=env, timeout_s=timeout_s)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    return [r.value for r in results]


def strict_step(config, rt):
    """On one rank under ``ExplicitDevices``: build the trainer, take a step (it creates the optimizers' state), count
    the host reads of a second, then evaluate and save a checkpoint (waited for); (the second step's record, its
    ``HostReads``)."""
    from zaya.distributed.checks import ExplicitDevices, HostReads
    from zaya.train.trainer import Trainer

    with ExplicitDevices():
        trainer = Trainer.build(config, rt, resume="never")
        try:
            trainer.step()
            with HostReads() as reads:
                record = trainer.step()
            trainer.evaluate()
            trainer.save("periodic")
            trainer.store.wait()
        finally:
            trainer.close()
    return record, reads
