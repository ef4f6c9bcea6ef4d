"""The distributed checkpoint store (``zaya.checkpoint.store.CheckpointStore``): parallel save, async save, RAM tier.

For each world size (``--world-sizes``, default 1, 2 and 4) the script spawns that many processes. They join one
gloo process group on 127.0.0.1 (a free port), and each runs with ``torch.set_num_threads(1)``. Every rank builds
the same model: ``--tensors`` fp32 matrices of ``[rows, --cols]`` (32 x [688, 4096] by default), each in its own
submodule, sharded with FSDP2 ``fully_shard`` (Shard(0) on a 1-D CPU mesh, every block and the root), so each rank
holds 1/world of every matrix. The parameters are filled with random values. One ``torch.optim.AdamW`` step with
random gradients then creates the two moments (``exp_avg``, ``exp_avg_sq``, sharded like the parameters). The
state, model plus optimizer, is ``state_bytes`` in total, whatever the world size: about 3x the parameters
(``--state-mib`` sets it, 1,024 MiB by default; rows are rounded up to a multiple of 8, so it is never less).

Timed, in this order, each ``--repeats`` times (3 by default). Each figure is one rank's wall time from a barrier
to the end of the operation, and the maximum over the ranks is taken (a collective is as slow as its slowest rank).
The key is the median over the repeats. Every checkpoint is deleted after its measurement.

(a) ``rank0_save_s``, the baseline. ``get_state_dict(model, [opt], StateDictOptions(full_state_dict=True,
    cpu_offload=True))`` gathers the full state to rank 0. Rank 0 then ``torch.save``s it to one file, flushes it and
    ``fsync``s it, as the store's own files are fsynced. Extras, from rank 0: ``rank0_gather_s`` (the gather) and
    ``rank0_write_s`` (torch.save + fsync).
(b) ``parallel_save_s``. ``CheckpointStore(dir, CheckpointConfig(async_save=False, ram_tier=False), runtime,
    parallel="fsdp").save(step, parts, meta, blocking=True)``, with ``parts`` = ``{"model": ModelState(model),
    "optim": OptimizerState(model, [opt])}`` (``zaya.checkpoint.parts``): each rank writes the entries it owns
    (here its FSDP2 shards) with DCP (fsynced), checksumming them (crc32) as it writes, and rank 0 commits. The
    outcome must be ok. The extra ``dcp_save_s`` is a plain ``torch.distributed.checkpoint.save`` of the same state
    to a new directory (DCP's write + fsync alone, without the store's checksums and commit). ``--no-breakdown``
    skips it.
(c) ``async_block_s``. The same store with ``async_save=True`` (``ram_tier=False``): the time until ``.save(...,
    blocking=False)`` returns, which is the copy of the state into host memory (staging). ``.wait()`` then collects
    the outcome outside the timed region, and it must be ok. Its ``seconds`` (the whole save, max over ranks) is
    the extra ``async_total_s``. The first async save allocates the staging buffers, and later ones reuse them
    (as in training), so it is also reported alone as ``async_block_first_s``. With 3 repeats the median is a
    reuse.
(d) ``ram_restore_s`` / ``disk_restore_s``. A third store, ``CheckpointConfig(async_save=False, ram_tier=True,
    ram_dir=<a directory under /dev/shm>)``, saves once. Then the script times ``store.select("auto")`` +
    ``store.load(path, parts)`` (a restart's whole restore, the checkpoint's verification included):
    - first ``--repeats`` times with the RAM tier present. ``meta["loaded_from"]`` must be ``"ram"``, and ``select``
      skips the checksums then.
    - Then ``forget_ram_tier()`` runs on every rank. Before each disk restore, every file of the checkpoint is
      evicted from the page cache with ``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` (after an ``fsync``, so
      every page is clean and can go). ``select`` then checks every file's checksum (split over the ranks), and
      ``load`` reads the state with DCP, so ``loaded_from`` must be ``"disk"``. This is ``disk_restore_s``.
      Directly after it, the same restore with the files in the page cache is the extra
      ``disk_warm_restore_s``.
    Before every restore the live parameters and moments are zeroed (untimed). After it their per-rank sums must
    equal those of the saved state exactly, so a restore that loads nothing fails the run. Extras
    ``ram_first_write_s`` / ``disk_first_write_s`` then time one in-place write of every byte of the restored state
    (``mul_(1.0)``). That is the extra cost the first optimizer step pays after the restore: it would be large if a
    restore left the state as copy-on-write mappings of the tier's file (an early version of the store did).
    ``ram_speedup_with_first_write`` includes it on both sides.

Ratios: ``parallel_speedup`` = rank0_save_s / parallel_save_s, ``async_block_fraction`` = async_block_s /
parallel_save_s, ``ram_speedup`` = disk_restore_s / ram_restore_s (``ram_speedup_warm`` uses the warm disk restore).

Before each timed operation, rank 0 waits (up to ``--quiet-timeout`` s: 5 by default, 0 with ``--quick``) until the
machine is idle (< 15% CPU busy over 0.5 s), because it may be shared. ``not_quiet`` counts the measurements that
started without that.

Checkpoints go under ``--dir`` (default: a new temporary directory on a disk filesystem, never tmpfs; with
``--dir`` a new subdirectory of it), the RAM tier under ``/dev/shm/zaya-bench-<pid>``. Both are removed at the end,
also after a failure. Run: ``PYTHONPATH=src python benchmarks/checkpoint.py [--quick] [--world-sizes 1,2,4]
[--state-mib MIB] [--repeats R] [--dir DIR]``. ``--quick`` means 128 MiB and 1 repeat, a smoke run of under a
minute. Human-readable progress goes to stderr, and stdout gets one JSON line per world size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HAVE_FADVISE = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")
RAM_FS = {"tmpfs", "ramfs"}
KEYS = ("world_size", "state_bytes", "rank0_save_s", "parallel_save_s", "async_block_s", "ram_restore_s",
        "disk_restore_s")


def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


# --- machine helpers -----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts; "" if unknown)."""
    path = Path(path).resolve()
    best, kind = "", ""
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


from quiet import wait_quiet  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def evict(directory: Path) -> int:
    """Drop every file under ``directory`` from the page cache (fsync first: only clean pages can go)."""
    count = 0
    for f in sorted(directory.rglob("*")):
        if not f.is_file():
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


# --- the state -----------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class Model(nn.Module):
    def __init__(self, tensors: int, rows: int, cols: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(rows, cols) for _ in range(tensors))


def rows_for(state_mib: float, tensors: int, cols: int) -> int:
    """Rows per matrix so that parameters + two AdamW moments reach ``state_mib`` (rounded up to a multiple of 8)."""
    per_row = 3 * tensors * cols * 4
    return max(8, math.ceil(state_mib * 2**20 / per_row / 8) * 8)


def build(rank: int, world: int, tensors: int, rows: int, cols: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = Model(tensors, rows, cols)  # torch.empty: only the local shard's pages are ever touched
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(seed + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(generator=gen)
            grad = torch.empty_like(p)
            grad.to_local().normal_(generator=gen)
            p.grad = grad
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def live_tensors(model, opt) -> list[torch.Tensor]:
    """This rank's local shards of the parameters and moments (the state a restore must bring back)."""
    out = []
    for p in model.parameters():
        out.append(p.to_local())
        for key in ("exp_avg", "exp_avg_sq"):
            out.append(opt.state[p][key].to_local())
    return out


def fingerprint(model, opt) -> list[float]:
    with torch.no_grad():
        return [float(t.double().sum()) for t in live_tensors(model, opt)]


def clobber(model, opt) -> None:
    with torch.no_grad():
        for t in live_tensors(model, opt):
            t.zero_()


def first_write(model, opt) -> None:
    """Write every byte of this rank's restored state once (``mul_(1.0)``, values unchanged): what the first
    optimizer step after a restore pays on top of its own work (page faults, copy-on-write of mapped pages)."""
    with torch.no_grad():
        for t in live_tensors(model, opt):
            t.mul_(1.0)


def state_bytes(model, opt) -> int:
    """Bytes of the whole (global) model + optimizer state: DTensors by their global size."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    def walk(v) -> int:
        if isinstance(v, torch.Tensor):
            return v.numel() * v.element_size()  # a DTensor's numel is the global one
        if isinstance(v, dict):
            return sum(walk(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(walk(x) for x in v)
        return 0

    return walk(get_state_dict(model, [opt], options=StateDictOptions()))


# --- one rank ------------------------------------------------------------------------------------------------------
class Timer:
    def __init__(self, rank: int, quiet_busy: float, quiet_timeout: float):
        self.rank, self.quiet_busy, self.quiet_timeout = rank, quiet_busy, quiet_timeout
        self.not_quiet = 0

    def max_over_ranks(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def __call__(self, fn):
        """(max over ranks of the time of ``fn()``, fn's result), started together after a quiet check. Rank 0
        first flushes every dirty page (``os.sync``, untimed), so no measurement pays for the previous one's
        writeback: without it the same save took 0.7 s after a sync-free idle and 1.8 s right after the baseline's
        1 GiB write."""
        if self.rank == 0:
            os.sync()
        flag = torch.tensor([1 if self.rank != 0 else int(wait_quiet(self.quiet_busy, self.quiet_timeout))])
        dist.broadcast(flag, 0)
        self.not_quiet += int(not flag.item())
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        return self.max_over_ranks(time.perf_counter() - t), out


def remove_on_rank0(rank: int, path: Path | None) -> None:
    dist.barrier()
    if rank == 0 and path is not None:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    dist.barrier()


def run_rank(rank: int, world: int, opts: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from zaya.checkpoint.parts import ModelState, OptimizerState
    from zaya.checkpoint.store import CheckpointStore
    from zaya.config import CheckpointConfig
    from zaya.distributed.runtime import Runtime

    runtime = Runtime(rank, world, rank, torch.device("cpu"), True, timeout_s=opts["timeout_s"])
    say = log if rank == 0 else (lambda m: None)
    root = Path(opts["dir"]) / f"world{world}"
    ram_dir = Path(opts["ram_dir"]) / f"world{world}"
    repeats = opts["repeats"]
    timer = Timer(rank, opts["quiet_busy"], opts["quiet_timeout"])

    def store_log(message: str) -> None:  # the store's own lines: warnings from any rank, the rest dropped
        if message.startswith("warning"):
            log(f"[rank {rank}] store: {message}")

    t_build = time.perf_counter()
    model, opt = build(rank, world, opts["tensors"], opts["rows"], opts["cols"], opts["seed"])
    total = state_bytes(model, opt)
    local = sum(t.numel() * t.element_size() for t in live_tensors(model, opt))
    say(f"world {world}: state {total / 2**30:.3f} GiB ({opts['tensors']} x [{opts['rows']}, {opts['cols']}] fp32 "
        f"+ 2 AdamW moments), {local / 2**20:.0f} MiB per rank; built in {time.perf_counter() - t_build:.1f} s")
    reference = fingerprint(model, opt)
    parts = {"model": ModelState(model), "optim": OptimizerState(model, [opt])}

    def meta(step: int) -> dict:  # the store adds step, save_id, world_size, parallel and the parts' names
        return {"benchmark": "checkpoint"}

    res: dict[str, list[float]] = {k: [] for k in ("rank0", "gather", "write", "parallel", "dcp", "block",
                                                  "async_total", "ram", "disk", "disk_warm", "ram_first_write",
                                                  "disk_first_write")}

    # (a) baseline: everything gathered to rank 0, one torch.save there
    base = root / "rank0"
    if rank == 0:
        base.mkdir(parents=True, exist_ok=True)
    for r in range(repeats):
        path = base / f"full-{r}.pt"
        timing = {}

        def rank0_save():
            t = time.perf_counter()
            msd, osd = get_state_dict(model, [opt], options=StateDictOptions(full_state_dict=True,
                                                                             cpu_offload=True))
            timing["gather"] = time.perf_counter() - t
            if rank == 0:
                t = time.perf_counter()
                with open(path, "wb") as fh:
                    torch.save({"model": msd, "optim": osd}, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                timing["write"] = time.perf_counter() - t
            del msd, osd

        dt, _ = timer(rank0_save)
        res["rank0"].append(dt)
        if rank == 0:
            res["gather"].append(timing["gather"])
            res["write"].append(timing["write"])
            size = path.stat().st_size
        say(f"  (a) rank-0 save {r + 1}/{repeats}: {dt:.2f} s" + (f" (gather {timing['gather']:.2f} s, write "
                                                                 f"{timing['write']:.2f} s, {size / 2**20:.0f} MiB)"
                                                                 if rank == 0 else ""))
        remove_on_rank0(rank, path)

    # (b) the store's parallel, blocking save (and plain DCP for the breakdown)
    sync_store = CheckpointStore(root / "sync" / "checkpoints", CheckpointConfig(async_save=False, ram_tier=False),
                                 runtime, parallel="fsdp", log=store_log)
    for r in range(repeats):
        dt, outcome = timer(lambda: sync_store.save(r + 1, parts, meta(r + 1), blocking=True))
        if outcome is None or not outcome.ok:
            raise RuntimeError(f"parallel save {r + 1} failed: {outcome}")
        res["parallel"].append(dt)
        say(f"  (b) parallel save {r + 1}/{repeats}: {dt:.2f} s")
        remove_on_rank0(rank, outcome.path)
        if opts["breakdown"]:
            path = root / "dcp" / f"step-{r}"

            def dcp_save():
                msd, osd = get_state_dict(model, [opt], options=StateDictOptions())
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

            dt, _ = timer(dcp_save)
            res["dcp"].append(dt)
            say(f"      plain DCP save (no checksums, no commit): {dt:.2f} s")
            remove_on_rank0(rank, path)

    # (c) the store's async save: the time training is blocked
    async_store = CheckpointStore(root / "async" / "checkpoints", CheckpointConfig(async_save=True, ram_tier=False),
                                  runtime, parallel="fsdp", log=store_log)
    for r in range(repeats):
        dt, ret = timer(lambda: async_store.save(r + 1, parts, meta(r + 1), blocking=False))
        if ret is not None:
            raise RuntimeError(f"async save {r + 1} returned {ret!r} instead of None (skipped or blocking?)")
        outcome = async_store.wait()
        if outcome is None or not outcome.ok:
            raise RuntimeError(f"async save {r + 1} failed: {outcome}")
        total_s = timer.max_over_ranks(outcome.seconds)
        res["block"].append(dt)
        res["async_total"].append(total_s)
        say(f"  (c) async save {r + 1}/{repeats}: blocked {dt:.3f} s (the whole save {total_s:.2f} s)")
        remove_on_rank0(rank, outcome.path)
    async_store.close()

    # (d) restore: RAM tier, then disk (cold page cache), then disk (warm)
    ram_store = CheckpointStore(root / "restore" / "checkpoints",
                                CheckpointConfig(async_save=False, ram_tier=True, ram_dir=str(ram_dir)),
                                runtime, parallel="fsdp", log=store_log)
    outcome = ram_store.save(1, parts, meta(1), blocking=True)
    if outcome is None or not outcome.ok:
        raise RuntimeError(f"save for the restore test failed: {outcome}")
    say(f"  (d) saved once for the restores ({outcome.seconds:.2f} s with the RAM-tier copy)")

    def restore(expect: str):
        def go():
            path = ram_store.select("auto")
            if path is None:
                raise RuntimeError("select('auto') found no checkpoint")
            return ram_store.load(path, parts)

        clobber(model, opt)
        dist.barrier()
        dt, got = timer(go)
        if got.get("loaded_from") != expect:
            raise RuntimeError(f"restore loaded from {got.get('loaded_from')!r}, expected {expect!r}")
        if fingerprint(model, opt) != reference:
            raise RuntimeError(f"restore from {expect} did not bring back the saved state (rank {rank})")
        first, _ = timer(lambda: first_write(model, opt))
        return dt, first

    for r in range(repeats):
        dt, first = restore("ram")
        res["ram"].append(dt)
        res["ram_first_write"].append(first)
        say(f"  (d) restore from the RAM tier {r + 1}/{repeats}: {dt:.2f} s (then a first write of the state "
            f"{first:.2f} s)")
    ram_store.forget_ram_tier()
    dist.barrier()
    for r in range(repeats):
        dist.barrier()
        files = evict(outcome.path) if rank == 0 else 0
        dist.barrier()
        dt, first = restore("disk")
        res["disk"].append(dt)
        res["disk_first_write"].append(first)
        res["disk_warm"].append(restore("disk")[0])
        say(f"  (d) restore from disk {r + 1}/{repeats}: {dt:.2f} s cold ({files} files evicted; then a first "
            f"write of the state {first:.2f} s), {res['disk_warm'][-1]:.2f} s warm")
    ram_store.close()
    remove_on_rank0(rank, outcome.path)

    if rank != 0:
        return {}
    med = {k: statistics.median(v) for k, v in res.items() if v}
    out = {"world_size": world, "state_bytes": total, "rank0_save_s": med["rank0"],
           "parallel_save_s": med["parallel"], "async_block_s": med["block"], "ram_restore_s": med["ram"],
           "disk_restore_s": med["disk"], "disk_warm_restore_s": med["disk_warm"],
           "parallel_speedup": med["rank0"] / med["parallel"], "async_block_fraction": med["block"] / med["parallel"],
           "ram_speedup": med["disk"] / med["ram"], "ram_speedup_warm": med["disk_warm"] / med["ram"],
           "repeats": repeats, "rank0_gather_s": med["gather"], "rank0_write_s": med["write"]}
    if "dcp" in med:
        out["dcp_save_s"] = med["dcp"]
    ram_total, disk_total = med["ram"] + med["ram_first_write"], med["disk"] + med["disk_first_write"]
    out.update(ram_first_write_s=med["ram_first_write"], disk_first_write_s=med["disk_first_write"],
               ram_speedup_with_first_write=disk_total / ram_total)
    out.update(async_total_s=med["async_total"], async_block_first_s=res["block"][0], bytes_per_rank=local,
               tensors=opts["tensors"], shape=[opts["rows"], opts["cols"]], threads_per_rank=torch.get_num_threads(),
               not_quiet=timer.not_quiet, runs={k: [round(x, 4) for x in v] for k, v in res.items() if v})
    return out


def worker(rank: int, world: int, port: int, opts: dict, result) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=opts["timeout_s"]))
    try:
        out = run_rank(rank, world, opts)
        if rank == 0:
            result["out"] = out
    finally:
        dist.destroy_process_group()


def rounded(out: dict) -> dict:
    def r(v):
        if isinstance(v, float):
            return round(v, 4)
        if isinstance(v, dict):
            return {k: r(x) for k, x in v.items()}
        return v

    return {k: r(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    p.add_argument("--state-mib", type=float, default=1024.0,
                   help="total model + optimizer state in MiB, the same at every world size (default 1024)")
    p.add_argument("--tensors", type=int, default=32, help="parameter matrices (default 32)")
    p.add_argument("--cols", type=int, default=4096, help="columns of each matrix (default 4096)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of each measurement (median; default 3)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (a new subdirectory is made there and "
                   "removed at the end); default: a temporary directory on a disk filesystem")
    p.add_argument("--no-breakdown", action="store_true", help="skip the plain-DCP save (extra dcp_save_s)")
    p.add_argument("--quiet-timeout", type=float, default=None,
                   help="seconds to wait for an idle machine before each measurement (0 = never; default 5, "
                   "--quick 0)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB of state, 1 repeat")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.state_mib, args.repeats = 128.0, 1
    if args.quiet_timeout is None:
        args.quiet_timeout = 0.0 if args.quick else 5.0
    worlds = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    if not worlds or min(worlds) < 1 or args.repeats < 1:
        p.error("--world-sizes needs positive integers and --repeats must be >= 1")
    if not HAVE_FADVISE:
        p.error("this benchmark needs os.posix_fadvise (Linux) to measure a cold disk restore")
    rows = rows_for(args.state_mib, args.tensors, args.cols)

    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        parent = Path(args.dir)
    else:
        parent = Path(tempfile.gettempdir())
        if fs_type(parent) in RAM_FS:
            parent = Path.cwd()
            log(f"{tempfile.gettempdir()} is RAM-backed ({fs_type(Path(tempfile.gettempdir()))}); writing "
                f"checkpoints under {parent} instead")
    work = Path(tempfile.mkdtemp(prefix="zaya-ckpt-bench-", dir=parent))
    kind = fs_type(work)
    if kind in RAM_FS:
        log(f"warning: {work} is on {kind}: 'disk' figures will be RAM figures")
    ram_root = Path(f"/dev/shm/zaya-bench-{os.getpid()}")
    state = 3 * args.tensors * rows * args.cols * 4
    log(f"checkpoints in {work} ({kind or 'unknown'} filesystem), RAM tier in {ram_root}; state {state / 2**30:.3f} "
        f"GiB; world sizes {worlds}; {args.repeats} repeat(s); torch {torch.__version__}, {os.cpu_count()} CPUs")
    for where, need in ((work, 2.2 * state), (Path("/dev/shm"), 1.2 * state + (128 << 20))):
        if where.exists() and shutil.disk_usage(where).free < need:
            log(f"warning: {where} has {shutil.disk_usage(where).free / 2**30:.1f} GiB free, the run needs about "
                f"{need / 2**30:.1f} GiB")
    opts = dict(dir=str(work), ram_dir=str(ram_root), repeats=args.repeats, tensors=args.tensors, rows=rows,
                cols=args.cols, seed=args.seed, breakdown=not args.no_breakdown, quiet_busy=0.15,
                quiet_timeout=args.quiet_timeout, timeout_s=1800.0)
    t0 = time.time()
    try:
        for world in worlds:
            t1 = time.time()
            with mp.Manager() as manager:
                result = manager.dict()
                mp.spawn(worker, args=(world, free_port(), opts, result), nprocs=world, join=True)
                out = dict(result["out"])
            out["dir_fs"] = kind
            out["seconds"] = time.time() - t1
            out = rounded(out)
            log(f"world {world}: rank-0 save {out['rank0_save_s']:.2f} s, parallel {out['parallel_save_s']:.2f} s "
                f"(x{out['parallel_speedup']:.2f}), async blocks {out['async_block_s']:.3f} s "
                f"({out['async_block_fraction']:.3f} of parallel), restore RAM {out['ram_restore_s']:.2f} s, disk "
                f"{out['disk_restore_s']:.2f} s cold (x{out['ram_speedup']:.2f}) / {out['disk_warm_restore_s']:.2f} s "
                f"warm; {out['seconds']:.0f} s")
            assert tuple(out)[:len(KEYS)] == KEYS
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ram_root, ignore_errors=True)
    log(f"done in {time.time() - t0:.0f} s; removed {work} and {ram_root}")


if __name__ == "__main__":
    main()
