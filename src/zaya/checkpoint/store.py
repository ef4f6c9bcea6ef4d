"""Training checkpoints: named stateful parts, saved in parallel (each rank only what it owns), optionally
asynchronously, committed atomically, verified on load, reshardable.

The store saves a dictionary of named parts (anything with ``state_dict()`` / ``load_state_dict()``), so new state
registers itself without changing the store: tensors go through DCP under ``<part>.<keys>``, other values into
``meta.json``. ``save`` is collective: each rank writes only what it owns (staging.py), checksumming as it writes
(writer.py), into a ``.partial`` directory that rank 0 commits (commit.py) and renames into place, so a crash
leaves the previous checkpoint the newest; async saves copy to host memory and write on a thread. ``select`` picks
the newest checkpoint that verifies, moving bad ones aside; ``load`` reads the RAM tier (ram_tier.py) when every
rank has a copy, else DCP's files through the allow-list reader (reader.py). Every collective goes through the
store's own two gloo ``HostGroup``s (one for the background save, one for the main thread's decisions and loads),
so they never interleave with training's. The layout and guarantees: docs/formats.md ("Training checkpoint") and
docs/training.md ("Checkpoints and exact resume").
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import resource
import shutil
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zaya.checkpoint.commit import (COMMIT, META, STEP_DIR, FileRecord, checksum_file, committed_checkpoints,
                                    is_complete, latest_checkpoint, list_checkpoints, new_checksum, newest_loadable,
                                    read_meta, step_dir_name, unloadable, verification_problem, write_commit)
from zaya.checkpoint.errors import CheckpointError
from zaya.checkpoint.parts import ABSENT, merge_state, split_state
from zaya.checkpoint.ram_tier import RamTier, ram_tier_directory, reassemble, restore_problem
from zaya.checkpoint.reader import first_failure, load_dcp
from zaya.checkpoint.staging import (HostBuffers, Ownership, assign_owners, local_view, ownership_rows, stage,
                                     tensor_bytes)
from zaya.checkpoint.writer import ChecksummingWriter
from zaya.config import CheckpointConfig
from zaya.distributed.runtime import Runtime
from zaya.core.errors import DISK_FULL_ERRNOS
from zaya.core.fsutil import atomic_write_bytes, read_json, replace_directory, restore_aside
from zaya.core.layout import checkpoints_dir

__all__ = ["COMMIT", "META", "RESERVED_META_KEYS", "CheckpointError", "CheckpointStore", "SaveOutcome", "Stateful",
           "check_model_config", "is_complete", "latest_checkpoint", "list_checkpoints", "read_meta",
           "step_dir_name"]

_RANK_FILE = re.compile(r"^__(\d+)_")
RESERVED_META_KEYS = ("step", "save_id", "world_size", "parallel", "parts", "loaded_from")
"""Keys of meta.json that the store itself writes (``loaded_from`` is added by ``load``): no part may be named so."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class SaveOutcome:
    step: int
    ok: bool
    path: Path | None = None
    error: str = ""
    seconds: float = 0.0
    blocked_seconds: float = 0.0
    nbytes: int = 0
    """Bytes of tensors in the checkpoint, all ranks together (each written once)."""
    rank_bytes: int = 0
    """Bytes of tensors this rank wrote (and, for an async save, staged)."""
    asynchronous: bool = False
    notes: tuple[str, ...] = ()
    """Warnings from the save (e.g. about the RAM tier), logged by the main thread when the outcome is collected."""


def _describe(exc: BaseException, directory: Path | None = None, nbytes: int = 0) -> str:
    """One line for an exception, with a hint for the errors a user can fix. With ``directory``, also the free
    space there: torch's file writers often report a full disk as an opaque RuntimeError."""
    full = str(exc)
    prefix, exc = first_failure(exc)
    lines = str(exc).strip().splitlines()
    text = prefix + f"{type(exc).__name__}" + (f": {lines[0]}" if lines else "")
    causes = [exc]
    while causes[-1].__cause__ is not None or causes[-1].__context__ is not None:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
        if len(causes) > 8:
            break
    codes = {getattr(c, "errno", None) for c in causes} | {e for e in DISK_FULL_ERRNOS
                                                            if f"[Errno {e}]" in full}
    if directory is not None:
        try:
            free = shutil.disk_usage(directory).free
            text += f" [{free / 2**20:,.0f} MiB free in {directory}]"
            if free < nbytes:
                codes.add(errno.ENOSPC)
        except OSError:
            pass
    # torch's zip writer turns a refused write into "unexpected pos": a file-size limit smaller than what this rank
    # writes is the likely cause then (and is named, as is a full disk, by its errno's own words).
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if not codes & DISK_FULL_ERRNOS and nbytes and size_limit != resource.RLIM_INFINITY and nbytes > size_limit:
        codes.add(errno.EFBIG)
        text += f" [a file-size limit (ulimit -f) of {size_limit:,} bytes is set]"
    found = sorted(codes & DISK_FULL_ERRNOS)
    if found:
        text += (f" ({os.strerror(found[0])}: the filesystem is full or refuses a file this large: free space or "
                 "point train.run_dir elsewhere)")
    return text


class CheckpointStore:
    """Saves and loads a run's checkpoints (see the module docstring). Every method is collective."""

    def __init__(self, directory: str | Path, config: CheckpointConfig, runtime: Runtime, *, parallel: str = "ddp",
                 run_dir: str | Path | None = None, log: Callable[[str], None] = print):
        self.directory = Path(directory)
        self.config = config if config is not None else CheckpointConfig()
        self.runtime = runtime
        self.rank, self.world_size, self.distributed = runtime.rank, runtime.world_size, runtime.distributed
        self.parallel = parallel
        self.log = log
        # Two gloo groups of their own: one for the background save's collectives, one for the main thread's
        # decisions while a save may be in flight (and for loads). Neither interleaves with training's.
        self._job = runtime.host_group()
        self._ctl = runtime.host_group()
        run_dir = Path(run_dir) if run_dir is not None else self.directory.parent
        # The tier's files exist (to clear) even with ram_tier off: a copy an earlier run left must not linger.
        self._ram_files = RamTier(ram_tier_directory(run_dir, self.config.ram_dir), run_dir, self.rank,
                                  self.world_size, parallel)
        self.ram = self._ram_files if self.config.ram_tier else None
        if self.ram is not None:
            self._open_ram_tier()
        self._ram_room_warned = False
        self._pin_warned = False
        self._buffers = HostBuffers()
        self._ownership: Ownership | None = None
        self._thread: threading.Thread | None = None
        self._pending_step = -1  # the step of the save in flight
        self._result: SaveOutcome | None = None
        self._ram_step: int | None = None  # the step select() found in every rank's RAM tier
        self.last_outcome: SaveOutcome | None = None
        self.fatal: SaveOutcome | None = None  # a failed save with on_error = "stop"
        self.committed_step: int | None = None  # the step of this process's newest committed save

    # ------------------------------------------------------------------------------------------------- parts
    @staticmethod
    def _check_names(parts: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> None:
        for name, part in parts.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"checkpoint part name {name!r}: must be a non-empty string without '.' (DCP keys "
                                 "are <part>.<nested keys>)")
            if name in RESERVED_META_KEYS:
                raise ValueError(f"checkpoint part name {name!r} is taken: meta.json's {', '.join(RESERVED_META_KEYS)} "
                                 "are the store's own keys; name the part otherwise")
            if meta is not None and name in meta:
                raise ValueError(f"checkpoint part name {name!r} is also a key of the meta passed to save(): both "
                                 f"would be meta.json's {name!r}; rename one")
            if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
                raise TypeError(f"checkpoint part {name!r} ({type(part).__name__}) has no state_dict() and "
                                "load_state_dict(state)")

    def _ownership_of(self, flat: Mapping[str, torch.Tensor]) -> Ownership:
        """Who writes which entry (staging.py), computed once and again only when some rank's keys change."""
        rows = ownership_rows(flat)
        mine = self._ownership
        if not self.distributed:
            if mine is None or mine.rows != rows:
                self._ownership = assign_owners([rows], 0)
            return self._ownership
        if self._ctl.any(mine is None or mine.rows != rows):
            self._ownership = assign_owners(self._ctl.all_gather_object(rows), self.rank)
        return self._ownership

    # -------------------------------------------------------------------------------------------------- save
    def save(self, step: int, parts: Mapping[str, Stateful], meta: dict[str, Any], blocking: bool | None = None,
             ram_copy: bool = True, closing: str = "") -> SaveOutcome | None:
        """Checkpoint the state of ``parts`` at ``step``, with ``meta`` (JSON) in meta.json. Blocking
        (``blocking=True``, or ``async_save = false``): returns the outcome once committed (or failed). Otherwise
        returns None once the state is staged; the write goes on in the background and ``wait`` (or the next save)
        collects its outcome. Returns None too when the save is skipped because the previous one is still writing
        (``when_busy = "skip"``). ``ram_copy=False`` leaves the RAM tier out of this save (a run's final
        checkpoint: nothing will restart from it in a hurry). A part whose non-tensor state is not JSON fails the
        save at once: its failed outcome is returned (and settled: with ``on_error = "stop"`` it raises), blocking
        or not. Non-tensor state must be the same on every rank: rank 0's is written. A part name that is one of
        ``RESERVED_META_KEYS``, a key of ``meta``, or has a '.' is a ValueError. ``closing``: why this is the run's
        last save ("final", a stop request, ...): it blocks, and its failure raises CheckpointError on every rank
        whatever ``on_error`` says (nothing trains after it, so "training goes on" would hide a lost run)."""
        blocking = True if closing else (not self.config.async_save) if blocking is None else blocking
        self._check_names(parts, meta)
        doc = copy.deepcopy(meta)  # the caller's meta as of now, whatever happens to it meanwhile
        t0 = time.perf_counter()
        # Every rank takes part, whether or not it still holds a thread: one rank may already have collected its
        # finished save (poll_failed) while another's is still writing.
        busy = self._ctl.any(self._thread is not None and self._thread.is_alive())
        if busy and self.config.when_busy == "skip" and not blocking:
            self.log(f"checkpoint at step {step} skipped: the previous save is still writing "
                     '(checkpoint.when_busy = "skip")')
            return None
        if self._thread is not None or closing:  # closing: collective (every rank agrees on the save in flight)
            self.wait(closing=bool(closing))
        flat: dict[str, torch.Tensor] = {}
        error = None
        try:
            for name, part in parts.items():
                _, rest, tensors = split_state(name, part.state_dict())  # rest: a copy, as of now
                flat.update(tensors)
                if not (rest == {} and tensors):
                    doc[name] = rest
        except TypeError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if self._ctl.any(error is not None):  # every rank stops here, before any collective of the save
            outcome = SaveOutcome(step, False, error=error or "a part's state could not be collected on another rank")
            self._settle(outcome, closing)
            return outcome
        doc.update(step=step, world_size=self.world_size, parallel=self.parallel, parts=list(parts))
        ownership = self._ownership_of(flat)
        owned = ownership.owned(flat)
        nbytes, rank_bytes = ownership.total_bytes, ownership.rank_bytes[self.rank]
        replicated = ownership.replicated
        if blocking:
            outcome = self._write(step, owned, replicated, doc, ram_copy)
            outcome.nbytes, outcome.rank_bytes, outcome.seconds = nbytes, rank_bytes, time.perf_counter() - t0
            outcome.blocked_seconds = outcome.seconds
            self._settle(outcome, closing)
            return outcome
        staged = stage(owned, self._buffers)
        if self._buffers.pin_failed and not self._pin_warned:
            self._pin_warned = True
            self.log(f"warning: checkpoint staging uses pageable host memory ({self._buffers.pin_failed}); async "
                     "saves block training longer")
        blocked = time.perf_counter() - t0
        self._pending_step = step

        def run() -> None:
            try:
                outcome = self._write(step, staged, replicated, doc, ram_copy)
            except BaseException as exc:  # noqa: BLE001 - reported through the outcome, never lost in a thread
                outcome = SaveOutcome(step, False, error=_describe(exc, self.directory))
            outcome.nbytes, outcome.rank_bytes, outcome.asynchronous = nbytes, rank_bytes, True
            outcome.blocked_seconds, outcome.seconds = blocked, time.perf_counter() - t0
            self._result = outcome

        # Not a daemon: an interpreter that exits (even without close()) first lets the save finish, instead of
        # killing the thread inside torch's writer (which aborts the process). Only a hard kill leaves a partial.
        self._thread = threading.Thread(target=run, name=f"zaya-checkpoint-{step}", daemon=False)
        self._thread.start()
        return None

    def wait(self, closing: bool = False) -> SaveOutcome | None:
        """Wait for the save in flight (if any) and return its outcome; raises if it failed and
        ``on_error = "stop"``. ``closing``: the run's closing save comes next (collective then: every rank agrees
        on the outcome), so a failure here is reported as such, not with "training goes on"."""
        outcome = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            outcome = self._result or SaveOutcome(self._pending_step, False, error="the save thread ended silently")
            self._result = None
        if closing:
            outcome = self._agree(outcome)
        if outcome is not None:
            self._settle(outcome, before_closing=closing)
        return outcome

    def _agree(self, outcome: SaveOutcome | None) -> SaveOutcome | None:
        """Collective: an outcome that succeeded here but failed on another rank is a failure on every rank."""
        failed_elsewhere = self._ctl.any(outcome is not None and not outcome.ok)
        if failed_elsewhere and outcome is not None and outcome.ok:
            return SaveOutcome(outcome.step, False, error="the save failed on another rank (see its log)")
        return outcome

    def committed(self, step: int) -> bool:
        """Collective: whether every rank saw this process's save of ``step`` commit (then a closing save of the
        same step is not needed)."""
        return not self._ctl.any(self.committed_step != step)

    def poll_failed(self) -> bool:
        """Whether a finished background save failed with ``on_error = "stop"`` (local; the trainer agrees on it
        across ranks with its per-step all-reduce). Collects a finished save's outcome without waiting."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait_quietly()
        return self.fatal is not None

    def wait_quietly(self) -> SaveOutcome | None:
        try:
            return self.wait()
        except CheckpointError:
            return self.last_outcome

    def _settle(self, outcome: SaveOutcome, closing: str = "", before_closing: bool = False) -> None:
        """Record and report a finished save. A failure raises with ``on_error = "stop"``, and always when the save
        was ``closing`` (the run's last one: agreed on every rank first); otherwise it is a warning."""
        if closing:
            outcome = self._agree(outcome)
        self.last_outcome = outcome
        for note in outcome.notes:
            self.log(f"warning: {note}")
        if outcome.ok:
            self.committed_step = outcome.step
            how = (f"async: training waited {outcome.blocked_seconds:.2f} s" if outcome.asynchronous
                   else "blocking")
            self.log(f"checkpoint {outcome.path} ({outcome.nbytes / 1e6:,.0f} MB, {outcome.seconds:.1f} s, {how})")
            return
        newest = latest_checkpoint(self.directory)
        message = f"checkpoint of step {outcome.step} failed: {outcome.error}."
        if closing:
            self.fatal = outcome
            raise CheckpointError(
                f"{message} It was the run's last checkpoint ({closing}), so the run stops without it: "
                + (f"the newest checkpoint is {newest}, where the same command resumes once the storage is fixed"
                   if newest else "this run has no checkpoint at all; fix the storage and run the same command "
                   "again"))
        message += f" The newest checkpoint is still {newest or 'none'}"
        if self.config.on_error == "stop":
            self.fatal = outcome
            raise CheckpointError(message + ' (checkpoint.on_error = "stop")')
        then = ("the run's closing checkpoint is written next" if before_closing
                else 'training goes on (set checkpoint.on_error = "stop" to stop instead)')
        self.log(f"warning: {message}; {then}")

    def _write(self, step: int, tensors: dict[str, torch.Tensor], replicated: list, doc: dict[str, Any],
               ram_copy: bool) -> SaveOutcome:
        """Write, checksum, commit: the collective body of a save (on the job group). ``tensors``: the entries
        this rank owns."""
        final = self.directory / step_dir_name(step)
        partial = self.directory / f".{final.name}.partial"
        group = self._job
        error, save_id = None, None
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._recover_leftovers()
                partial.mkdir()
                save_id = uuid.uuid4().hex
            except OSError as exc:
                error = _describe(exc, self.directory)
        error, save_id = group.broadcast_object((error, save_id))
        if error:
            return SaveOutcome(step, False, error=error)
        doc["save_id"] = save_id  # also in the RAM tier's info: ties a RAM copy to this very save

        local_error, records, pending = None, {}, None
        try:
            writer = ChecksummingWriter(partial, self.config.checksum)
            dcp.save(tensors, storage_writer=writer, process_group=group.pg, no_dist=not self.distributed)
        except (Exception, CheckpointException) as exc:  # DCP raises on every rank when any rank's write fails
            local_error = _describe(exc, self.directory, tensor_bytes(tensors))
        if local_error is None:
            try:
                records = self._checksum_own_files(partial, writer.checksums(partial))
            except OSError as exc:
                local_error = _describe(exc, self.directory)
        notes: list[str] = []
        if self.ram is not None and ram_copy:
            self.ram.invalidate()  # whatever happens next, the copy there now is older than the disk's newest
            if local_error is None:
                pending = self._write_ram(tensors, replicated, step, notes)
        gathered = group.all_gather_object((local_error, records))

        outcome = SaveOutcome(step, False)
        if self.rank == 0:
            errors = [e for e, _ in gathered if e]
            if errors:
                outcome.error = errors[0]
            else:
                try:
                    outcome = self._commit(step, partial, final, doc, {k: v for _, r in gathered
                                                                       for k, v in r.items()})
                except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks as an outcome
                    outcome.error = _describe(exc, self.directory)
            if not outcome.ok:
                shutil.rmtree(partial, ignore_errors=True)
        outcome = group.broadcast_object(outcome)
        if self.ram is not None and ram_copy:
            if outcome.ok and pending is not None:
                try:
                    self.ram.publish(pending, step, save_id)
                except Exception as exc:  # noqa: BLE001 - the RAM tier is an optimisation: never fail a save
                    RamTier.discard(pending)
                    notes.append(f"RAM tier copy of step {step} not kept ({_describe(exc)}); disk only")
            else:
                RamTier.discard(pending)
        outcome.notes = tuple(notes)
        return outcome

    def _checksum_own_files(self, partial: Path, written: dict[str, FileRecord]) -> dict[str, FileRecord]:
        """Size and checksum of the files this rank wrote (rank 0 also takes any file no rank's name claims):
        from the writer, which checksummed them on the way out, or else by reading them back."""
        records = {}
        for f in sorted(partial.iterdir()):
            if not f.is_file():
                continue
            match = _RANK_FILE.match(f.name)
            owner = int(match.group(1)) if match and int(match.group(1)) < self.world_size else 0
            if owner == self.rank:
                records[f.name] = written.get(f.name) or FileRecord(
                    f.stat().st_size, self.config.checksum, checksum_file(f, self.config.checksum))
        return records

    def _write_ram(self, tensors: dict[str, torch.Tensor], replicated: list, step: int,
                   notes: list[str]) -> Path | None:
        local = local_view(tensors)
        nbytes = tensor_bytes(local)
        try:
            if not self.ram.room_for(nbytes):
                if not self._ram_room_warned:
                    notes.append(f"{self.ram.directory.parent} has no room for a {nbytes / 2**20:.0f} MiB RAM tier "
                                 "copy; restarts will load from disk (set checkpoint.ram_dir, or ram_tier = false)")
                    self._ram_room_warned = True
                return None
            return self.ram.write_pending(local, replicated, step)
        except Exception as exc:  # noqa: BLE001 - the RAM tier is an optimisation: never fail a save
            notes.append(f"RAM tier copy of step {step} failed ({_describe(exc)}); restarts load from disk")
            return None

    def _commit(self, step: int, partial: Path, final: Path, doc: dict[str, Any],
                records: dict[str, FileRecord]) -> SaveOutcome:
        body = (json.dumps(doc, indent=1) + "\n").encode()
        atomic_write_bytes(partial / META, body)
        digest = new_checksum(self.config.checksum)
        digest.update(body)
        records[META] = FileRecord(len(body), self.config.checksum, digest.hexdigest())
        write_commit(partial, step, records)
        replace_directory(partial, final)  # re-saving a step (after a resume) swaps the old one out
        self._retain()
        return SaveOutcome(step, True, path=final)

    def _retain(self) -> None:
        """Keep the newest ``keep`` complete checkpoints, and those whose step is a multiple of ``keep_every``."""
        done = list_checkpoints(self.directory)
        every = self.config.keep_every
        for old in done[:-self.config.keep]:
            step = int(STEP_DIR.match(old.name).group(1))
            if every and step % every == 0:
                continue
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Finish the save in flight (a process that exits normally never abandons one) and release the staging
        buffers (page-locked memory is unregistered before it is unmapped)."""
        self.wait_quietly()
        self._buffers.release()

    def _open_ram_tier(self) -> None:
        """Take up the RAM tier (ram_owners: private directories, this process as the owner, the copies of runs
        that ended removed), or keep to disk with a warning when its directory is not this user's alone."""
        try:
            swept = self.ram.open()
        except OSError as exc:
            self.log(f"warning: RAM tier off ({exc}); restarts load from disk. Set checkpoint.ram_dir to a "
                     "directory of your own (created mode 0700), or remove that one")
            self.ram = None
            return
        if swept and self.rank == 0:
            self.log(f"removed the RAM-tier copies of {len(swept)} ended run(s) no process uses any more: "
                     + ", ".join(str(p) for p in swept))

    def forget_ram_tier(self) -> None:
        """Drop this rank's RAM-tier copy (a finished run, or a run started afresh), even with the tier off."""
        self._ram_files.clear()

    def _recover_leftovers(self) -> None:
        """Rank 0: remove dead saves' partial directories, and undo a re-save's swap that a crash cut short."""
        if not self.directory.is_dir():
            return
        for stale in self.directory.glob(".step-*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        for aside in self.directory.glob(".step-*.old"):
            restore_aside(self.directory / aside.name[1:-len(".old")])

    # -------------------------------------------------------------------------------------------------- load
    def _verify(self, path: Path) -> str | None:
        """Collective: why ``path`` must not be loaded, or None. Checksums are split over the ranks."""
        problem = verification_problem(path, self.config.verify == "checksum", self.rank, self.world_size)
        problems = [p for p in self._ctl.all_gather_object(problem) if p]
        return problems[0] if problems else None

    def _move_aside(self, path: Path, why: str = "corrupt") -> Path:
        aside = path.with_name(f"{why}-{path.name}")
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{why}-{path.name}.{n}")
        os.replace(path, aside)
        return aside

    def select(self, resume: str) -> Path | None:
        """The checkpoint to resume from (collective). ``resume``: "never", "auto" (the newest one in this store
        that passes verification; failures are reported and moved aside) or a path (one checkpoint, which must pass
        verification, or a run directory: its newest checkpoint that passes, each newer one reported and left in
        place). A step directory without a COMMIT marker (a save that died) is no candidate; one with a marker that
        fails any check (the marker itself, a file's presence, kind or size, a checksum) is reported."""
        self._ram_step = None
        if self.rank == 0:
            self._recover_leftovers()
        self._ctl.barrier()
        if resume == "never":
            self.forget_ram_tier()
            return None
        if resume != "auto":
            path = Path(resume)
            if checkpoints_dir(path).is_dir():
                path = self._newest_of_run(checkpoints_dir(path))
            else:
                problem = self._verify(path)
                if problem is not None:
                    raise unloadable(path, problem)
            self._abandon_newer_than(path)
            return path

        def problem_of(path: Path) -> str | None:
            step = int(STEP_DIR.match(path.name).group(1))
            if self.ram is not None and not self._ctl.any(not self.ram.holds(step, _save_id(path),
                                                                             self.config.ram_verify)):
                self._ram_step = step
                return None
            return self._verify(path)

        def skipped(path: Path, problem: str) -> None:
            if self.rank == 0:
                try:
                    where = f"moved to {self._move_aside(path, 'corrupt')}"
                except OSError as exc:  # a run directory this process cannot change: skip it where it is
                    where = f"left in place ({exc.strerror or exc})"
                self.log(f"warning: checkpoint {path} failed verification ({problem}); {where}, trying the previous "
                         "one")
            self._ctl.barrier()

        candidates = self._ctl.broadcast_object([str(p) for p in committed_checkpoints(self.directory)])
        chosen = newest_loadable([Path(name) for name in candidates], problem_of, skipped)
        if chosen is None:
            self.forget_ram_tier()  # nothing to resume: a copy there belongs to something else
        return chosen

    def _newest_of_run(self, checkpoints: Path) -> Path:
        """The newest checkpoint of another run's ``checkpoints`` directory that passes verification (collective);
        each newer one is reported and left where it is (that run directory is not this store's to change)."""
        failures: list[str] = []

        def skipped(path: Path, problem: str) -> None:
            failures.append(f"{path.name}: {problem}")
            if self.rank == 0:
                self.log(f"warning: checkpoint {path} failed verification ({problem}); left in place, trying the "
                         "previous one")

        candidates = self._ctl.broadcast_object([str(p) for p in committed_checkpoints(checkpoints)])
        chosen = newest_loadable([Path(name) for name in candidates], self._verify, skipped)
        if chosen is None:
            found = f" ({'; '.join(failures)})" if failures else ""
            raise CheckpointError(f"{checkpoints}: no complete checkpoint passes verification{found}")
        return chosen

    def _abandon_newer_than(self, path: Path) -> None:
        """Resuming this store's run from an older checkpoint starts a new timeline: the newer checkpoints of the
        old one are moved aside (``abandoned-step-N``), or retention and the next ``--resume auto`` would prefer
        them to the new run's saves."""
        if path.resolve().parent != self.directory.resolve():
            return
        if self.rank == 0:
            step = int(STEP_DIR.match(path.name).group(1))
            newer = [p for p in list_checkpoints(self.directory) if int(STEP_DIR.match(p.name).group(1)) > step]
            for p in newer:
                aside = self._move_aside(p, "abandoned")
                self.log(f"resuming from {path}: the newer checkpoint {p.name} is moved to {aside.name} (kept, "
                         "never loaded)")
        self._ctl.barrier()

    def load(self, path: Path, parts: Mapping[str, Stateful]) -> dict:
        """Load the state of ``parts`` from ``path`` (or from the RAM tier, when ``select`` found every rank
        holding that step): tensors in place into each part's current ``state_dict()`` tensors, then
        ``part.load_state_dict`` with them and the part's non-tensor state from meta.json. Returns the checkpoint's
        meta (meta.json), with ``meta["loaded_from"]`` = "ram" or "disk". A part the checkpoint has no state for is
        a CheckpointError naming both. Collective."""
        path = Path(path)
        self._check_names(parts)
        meta = read_meta(path)
        saved_parts = meta.get("parts")
        for name in parts:
            if not isinstance(saved_parts, list) or name not in saved_parts:
                listed = ", ".join(map(str, saved_parts)) if isinstance(saved_parts, list) else "none listed"
                raise CheckpointError(f"{path}: has no state for the checkpoint part {name!r} (its parts: {listed}); "
                                      "made by another version or for another setup")
        trees: dict[str, Any] = {}
        flat: dict[str, torch.Tensor] = {}
        for name, part in parts.items():
            trees[name], _, tensors = split_state(name, part.state_dict(), check_json=False)
            flat.update(tensors)
        from_ram = self._ram_step is not None and self._ram_step == meta["step"] and self.ram is not None
        if from_ram:
            from_ram = self._load_ram(path, flat)
        if not from_ram:
            load_dcp(path, flat, process_group=self._ctl.pg, distributed=self.distributed)
        with torch.no_grad():
            for name, part in parts.items():
                part.load_state_dict(merge_state(meta.get(name, ABSENT), trees[name]))
        meta["loaded_from"] = "ram" if from_ram else "disk"
        return meta

    def _load_ram(self, path: Path, flat: dict[str, torch.Tensor]) -> bool:
        """Restore ``flat`` from the RAM tier (every rank its own copy, owners broadcasting the replicated
        entries); False, on every rank, when some rank's copy cannot be read or does not fit its live state."""
        live = local_view(flat)
        # Read every rank's copy first and agree: a copy that cannot be read (it was checked by size and save_id,
        # and by crc32 with ram_verify) sends every rank to the disk, never into a crash loop.
        try:
            saved, error = self.ram.read(), None
            problem = restore_problem(saved, live, self.rank)
        except Exception as exc:  # noqa: BLE001 - any unreadable copy means disk
            saved, error, problem = None, exc, None
        if self._ctl.any(error is not None or problem is not None):
            if error is not None:
                self.log(f"warning: RAM tier copy {self.ram.data_path} cannot be read ({_describe(error)}); "
                         "loading from disk")
            elif problem is not None:
                self.log(f"warning: RAM tier copy {self.ram.data_path} does not match this run's state ({problem}); "
                         "loading from disk")
            del saved
            self.forget_ram_tier()
            problem = self._verify(path)  # select skipped it because the RAM copy was to be used
            if problem is not None:
                raise CheckpointError(f"{path}: cannot be loaded: {problem}")
            return False
        reassemble(saved, live, self.rank, self._ctl)
        del saved  # drop the file mapping
        return True


def _save_id(path: Path) -> str | None:
    """meta.json's save_id, or None when it has none (a damaged file is found by verification, not here)."""
    try:
        meta = read_json(path / META) if stat.S_ISREG(os.lstat(path / META).st_mode) else None
    except (OSError, ValueError):
        return None
    return meta.get("save_id") if isinstance(meta, dict) else None


def check_model_config(meta: dict[str, Any], model_config: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint made for another model shape, naming the first differing key."""
    saved = meta.get("model_config", {})
    for key in sorted(set(saved) | set(model_config)):
        if saved.get(key) != model_config.get(key):
            raise CheckpointError(f"{path}: made for a different model: model.{key} = {saved.get(key)!r} there, "
                                  f"{model_config.get(key)!r} here (use --resume never or a new --run-dir to "
                                  "start fresh)")
