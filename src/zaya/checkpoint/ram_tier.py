"""The fast-recovery tier: the newest checkpoint kept in host shared memory, each rank its own part.

A crashed training process is usually restarted at once, on the same nodes, at the same world size: reading the
whole checkpoint back from disk (or a network filesystem) is then the slowest part of the restart. So every save
also leaves what each rank wrote (the tensors it owns, exactly as they are in memory: see ``staging``) in a file on
a RAM-backed filesystem of its node (``/dev/shm`` by default)::

    /dev/shm/zaya-<uid>/<run name>-<hash of the run directory>/     both mode 0700 (ram_owners)
        rank-00000.pt      torch.save of {"format": 2, "tensors": {DCP key: tensor}, "replicated": [...]}: the
                           tensors this rank owns (DTensors as their local shards), and the table of replicated
                           keys ([key, owner, dtype, shape, holders], the same on every rank)
        rank-00000.json    {"format", "step", "save_id", "world_size", "parallel", "size", "crc32", "run_dir"}:
                           written after the .pt
        rank-00000.owner.json   the process using it, its launcher and supervisor (ram_owners)

Under DDP and ZeRO-1 the replicated model (and DDP's optimizer state) is written once, each key by its owner, so a
rank's file holds about 1/world of it. A restore (``reassemble``) copies every rank's own file into its live
tensors, then the owners send the replicated entries to the other holders: one coalesced broadcast per owner and
dtype (in buckets of at most 256 MiB) on the store's gloo group.

A restart loads from there only if *every* rank has an intact copy (its size, and with ``ram_verify`` its crc32,
rechecked) of the very save that is the newest committed checkpoint on disk (same step and the same random
``save_id`` as its meta.json, so a copy left by another run in the same directory never matches), saved at the same
world size and parallel mode (so each rank's shards and owned keys are its own again), and if every rank's copy
covers its live state (checked, and agreed, before any broadcast); otherwise it loads from disk, which reshards. A
copy is published (renamed into place) only after the disk checkpoint of the same step has committed, so the RAM
tier is never ahead of the disk. It lives in memory that outlasts the process: a finished run removes it, a run
started with ``--resume never`` clears it, ``checkpoint.ram_tier = false`` turns it off, and ``ram_owners`` says
what removes the copies of runs that ended otherwise, and who may own the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from zaya.checkpoint import ram_owners
from zaya.core.device import to_dtype
from zaya.core.fsutil import atomic_write_text, read_json

DEFAULT_DIR = f"/dev/shm/zaya-{os.getuid()}"
"""Per user: a directory of the user's own (mode 0700), which no other user can have made first under that name
without being refused (``ram_owners.problem``)."""
FORMAT = 2
"""Of a rank's file (and its info): 2 = owned tensors plus the replicated-key table."""
BUCKET_BYTES = 256 << 20


def ram_tier_directory(run_dir: str | Path, ram_dir: str = "") -> Path:
    """The node-local directory of one run's RAM tier (keyed by the run directory's absolute path)."""
    run_dir = Path(run_dir).resolve()
    key = hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    return Path(ram_dir or DEFAULT_DIR) / f"{run_dir.name}-{key}"


class RamTier:
    """One rank's copy in one run's directory of the tier. ``problem``: why the directory may not be used (not this
    user's alone: ``ram_owners``), or None; with a problem, nothing here reads, writes or removes a file."""

    def __init__(self, directory: Path, run_dir: Path, rank: int, world_size: int, parallel: str):
        self.directory = directory
        self.run_dir = str(Path(run_dir).resolve())
        self.rank = rank
        self.world_size = world_size
        self.parallel = parallel
        self.problem = ram_owners.problem(directory.parent) or ram_owners.problem(directory)

    def open(self) -> list[Path]:
        """Start using the tier: create its directories private (PermissionError naming one that is not this
        user's alone), record this process as the copy's owner, and sweep the directories of runs that ended
        (returned)."""
        if self.problem:
            raise PermissionError(f"{self.problem}: not used for the RAM tier")
        ram_owners.make_private(self.directory.parent, self.directory)
        ram_owners.claim(self.directory, self.rank)
        return ram_owners.sweep(self.directory.parent, keep=self.directory)

    @property
    def data_path(self) -> Path:
        return self.directory / f"rank-{self.rank:05d}.pt"

    @property
    def info_path(self) -> Path:
        return self.directory / f"rank-{self.rank:05d}.json"

    def room_for(self, nbytes: int) -> bool:
        """Whether the filesystem has space for a copy of ``nbytes`` (plus 10%) next to the current one."""
        probe = self.directory
        while not probe.exists():
            probe = probe.parent
        return shutil.disk_usage(probe).free > nbytes * 1.1 + (64 << 20)

    def write_pending(self, tensors: dict[str, torch.Tensor], replicated: list, step: int) -> Path:
        """Write this rank's owned tensors (local shards) and the replicated-key table under a temporary name;
        ``publish`` makes it the tier's copy."""
        ram_owners.make_private(self.directory.parent, self.directory)
        ram_owners.claim(self.directory, self.rank)  # again: --resume never, or a sweep, may have removed it
        pending = self.directory / f".rank-{self.rank:05d}.step-{step:08d}.pending"
        try:
            torch.save({"format": FORMAT, "tensors": tensors, "replicated": replicated}, pending)
        except BaseException:
            pending.unlink(missing_ok=True)
            raise
        return pending

    def publish(self, pending: Path, step: int, save_id: str) -> None:
        """Replace the tier's copy with ``pending`` (the info file goes last: it is what makes the copy valid)."""
        self.info_path.unlink(missing_ok=True)
        os.replace(pending, self.data_path)
        info = {"format": FORMAT, "step": step, "save_id": save_id, "world_size": self.world_size,
                "parallel": self.parallel, "size": self.data_path.stat().st_size, "crc32": _crc32(self.data_path),
                "run_dir": self.run_dir}
        atomic_write_text(self.info_path, json.dumps(info) + "\n")

    def invalidate(self) -> None:
        """Make the current copy (if any) invalid before it is replaced, so no failure can leave a stale one."""
        self.info_path.unlink(missing_ok=True)

    @staticmethod
    def discard(pending: Path | None) -> None:
        if pending is not None:
            pending.unlink(missing_ok=True)

    def holds(self, step: int, save_id: str | None, verify: bool = False) -> bool:
        """This rank has a copy of the save ``save_id`` of ``step`` at this world size and parallel mode, of the
        recorded size, and (``verify``) whose crc32 still matches: that reads the whole copy, about 0.4 s per GiB
        per core, which is why it is optional (the copy lives in memory and was published atomically)."""
        if self.problem:
            return False
        try:
            info = read_json(self.info_path)
            return (info.get("format") == FORMAT and save_id is not None and info["save_id"] == save_id
                    and info["step"] == step and info["world_size"] == self.world_size
                    and info["parallel"] == self.parallel and info["run_dir"] == self.run_dir
                    and self.data_path.stat().st_size == info["size"]
                    and (not verify or _crc32(self.data_path) == info["crc32"]))
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def read(self) -> dict[str, Any]:
        return torch.load(self.data_path, map_location="cpu", weights_only=True, mmap=True)

    def clear(self) -> None:
        """Remove this rank's copy and owner record (and the run's directory once it is empty)."""
        if self.problem:
            return
        for path in (self.info_path, self.data_path):
            path.unlink(missing_ok=True)
        ram_owners.release(self.directory, self.rank)
        try:
            for stale in self.directory.glob(f".rank-{self.rank:05d}.*.pending"):
                stale.unlink(missing_ok=True)
        except FileNotFoundError:  # no directory, or another rank of this node emptied and removed it meanwhile
            pass
        for empty in (self.directory, self.directory.parent):
            if empty == self.directory.parent and str(empty) != DEFAULT_DIR:
                break  # a directory the user chose is theirs to keep
            try:
                empty.rmdir()
            except OSError:
                break


def restore_problem(saved: Any, live: dict[str, torch.Tensor], rank: int) -> str | None:
    """Why this rank's copy ``saved`` (``RamTier.read``) cannot restore ``live`` (its flat live state, local
    shards), or None. Checked on every rank, and agreed, before ``reassemble`` starts its broadcasts."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        return "not a RAM-tier copy of this format"
    tensors, table = saved["tensors"], {row[0]: row for row in saved["replicated"]}
    for key, target in live.items():
        row = table.get(key)
        if row is not None:
            _, owner, dtype, shape, holders = row
            if rank not in holders:
                return f"{key} was not held by rank {rank} when saved"
            if str(target.dtype) != dtype or list(target.shape) != list(shape):
                return f"{key} is {dtype} {list(shape)} there, {target.dtype} {list(target.shape)} here"
        elif key not in tensors:
            return f"no copy of {key}"
        if key in tensors and (tensors[key].shape != target.shape or tensors[key].dtype != target.dtype):
            return (f"{key} is {tensors[key].dtype} {list(tensors[key].shape)} there, {target.dtype} "
                    f"{list(target.shape)} here")
    missing = [row[0] for row in saved["replicated"] if row[1] == rank and row[0] not in tensors]
    return f"rank {rank} owns {missing[0]} but its copy lacks it" if missing else None


def _buckets(table: list, bucket_bytes: int) -> list[tuple[int, torch.dtype, list]]:
    """The replicated rows as ``(owner, dtype, rows)`` buckets: per owner and dtype, at most ``bucket_bytes`` each
    (a larger tensor alone). The same on every rank: the table is."""
    groups: dict[tuple[int, str], list] = {}
    for row in sorted(table, key=lambda r: (r[1], r[2], r[0])):
        groups.setdefault((row[1], row[2]), []).append(row)
    out = []
    for (owner, name), rows in sorted(groups.items()):
        dtype = to_dtype(name)
        current, size = [], 0
        for row in rows:
            n = _numel(row[3]) * dtype.itemsize
            if current and size + n > bucket_bytes:
                out.append((owner, dtype, current))
                current, size = [], 0
            current.append(row)
            size += n
        if current:
            out.append((owner, dtype, current))
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def reassemble(saved: dict[str, Any], live: dict[str, torch.Tensor], rank: int, group: Any,
               bucket_bytes: int = BUCKET_BYTES) -> int:
    """Restore ``live`` (this rank's flat live state, local shards) from every rank's copy: this rank's own
    tensors are copied in place, then each owner broadcasts its replicated entries (coalesced per dtype) on
    ``group`` (a ``HostGroup``) and every other holder copies them in. Collective. Returns the bytes received.

    Copies, never the tensors of the file themselves: a tensor handed over as it is would stay a copy-on-write
    mapping of the file, so the first optimizer step would fault on every page, and the file's memory could not be
    freed while the run lasts."""
    received = 0
    with torch.no_grad():
        for key, tensor in saved["tensors"].items():
            if key in live:
                live[key].copy_(tensor)
        for owner, dtype, rows in _buckets(saved["replicated"], bucket_bytes):
            sizes = [_numel(row[3]) for row in rows]
            if sum(sizes) == 0:
                continue  # empty tensors: nothing to send (the same decision on every rank)
            if owner == rank:
                parts = [saved["tensors"][row[0]].reshape(-1) for row in rows]
                flat = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device="cpu")
            group.broadcast(flat.view(torch.uint8), src=owner)  # bytes: gloo need not know the dtype (bool, ...)
            if owner == rank:
                continue
            offset = 0
            for row, n in zip(rows, sizes):
                if row[0] in live:
                    live[row[0]].copy_(flat[offset:offset + n].view(row[3]))
                    received += n * dtype.itemsize
                offset += n
    return received


def _crc32(path: Path) -> str:
    from zaya.checkpoint.commit import checksum_file

    return checksum_file(path, "crc32")
