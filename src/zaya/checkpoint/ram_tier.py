"""The fast-recovery tier: the newest checkpoint kept in host shared memory, each rank its own part.

A crashed training process is usually restarted at once, on the same nodes, at the same world size: reading the
whole checkpoint back from disk (or a network filesystem) is then the slowest part of the restart. So every save
also leaves each rank's own state (its parameters, or shards of them, and its optimizer state, exactly as they are
in memory) in a file on a RAM-backed filesystem of its node (``/dev/shm`` by default)::

    /dev/shm/zaya/<run name>-<hash of the run directory>/
        rank-00000.pt      torch.save of rank 0's state (DTensors as their local shards)
        rank-00000.json    {"step", "save_id", "world_size", "parallel", "size", "crc32", "run_dir"}: written
                           after the .pt

A restart loads from there only if *every* rank has an intact copy (its size, and with ``ram_verify`` its crc32,
rechecked) of the very save
that is the newest committed checkpoint on disk (same step and the same random ``save_id`` as its meta.json, so a
copy left by another run in the same directory never matches), saved at the same world size and parallel mode (so
each rank's shards are its own again); otherwise it loads from disk, which reshards. A copy is published (renamed into place) only after the disk checkpoint of the same
step has committed, so the RAM tier is never ahead of the disk. It lives in memory that outlasts the process: a
finished run removes it, a run started with ``--resume never`` clears it, and ``checkpoint.ram_tier = false`` turns
it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

DEFAULT_DIR = "/dev/shm/zaya"


def ram_tier_directory(run_dir: str | Path, ram_dir: str = "") -> Path:
    """The node-local directory of one run's RAM tier (keyed by the run directory's absolute path)."""
    run_dir = Path(run_dir).resolve()
    key = hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    return Path(ram_dir or DEFAULT_DIR) / f"{run_dir.name}-{key}"


class RamTier:
    def __init__(self, directory: Path, run_dir: Path, rank: int, world_size: int, parallel: str):
        self.directory = directory
        self.run_dir = str(Path(run_dir).resolve())
        self.rank = rank
        self.world_size = world_size
        self.parallel = parallel

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

    def write_pending(self, local_state: dict[str, Any], step: int) -> Path:
        """Write this rank's state under a temporary name; ``publish`` makes it the tier's copy."""
        self.directory.mkdir(parents=True, exist_ok=True)
        pending = self.directory / f".rank-{self.rank:05d}.step-{step:08d}.pending"
        try:
            torch.save(local_state, pending)
        except BaseException:
            pending.unlink(missing_ok=True)
            raise
        return pending

    def publish(self, pending: Path, step: int, save_id: str) -> None:
        """Replace the tier's copy with ``pending`` (the info file goes last: it is what makes the copy valid)."""
        self.info_path.unlink(missing_ok=True)
        os.replace(pending, self.data_path)
        info = {"step": step, "save_id": save_id, "world_size": self.world_size, "parallel": self.parallel,
                "size": self.data_path.stat().st_size, "crc32": _crc32(self.data_path), "run_dir": self.run_dir}
        tmp = self.info_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(info) + "\n")
        os.replace(tmp, self.info_path)

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
        try:
            info = json.loads(self.info_path.read_text())
            return (save_id is not None and info["save_id"] == save_id and info["step"] == step
                    and info["world_size"] == self.world_size and info["parallel"] == self.parallel
                    and info["run_dir"] == self.run_dir and self.data_path.stat().st_size == info["size"]
                    and (not verify or _crc32(self.data_path) == info["crc32"]))
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def read(self) -> dict[str, Any]:
        return torch.load(self.data_path, map_location="cpu", weights_only=True, mmap=True)

    def clear(self) -> None:
        """Remove this rank's copy (and the run's directory once it is empty)."""
        for path in (self.info_path, self.data_path):
            path.unlink(missing_ok=True)
        for stale in self.directory.glob(f".rank-{self.rank:05d}.*.pending") if self.directory.is_dir() else []:
            stale.unlink(missing_ok=True)
        for empty in (self.directory, self.directory.parent):
            if empty == self.directory.parent and str(empty) != DEFAULT_DIR:
                break  # a directory the user chose is theirs to keep
            try:
                empty.rmdir()
            except OSError:
                break


def _crc32(path: Path) -> str:
    from zaya.checkpoint.commit import checksum_file

    return checksum_file(path, "crc32")
