"""Training checkpoints: parallel, optionally asynchronous, committed atomically, verified on load, reshardable.

Layout under ``<run_dir>/checkpoints/``::

    step-00000100/            a complete checkpoint
        .metadata, __*_*.distcp   torch.distributed.checkpoint (DCP) files: model and optimizer state; every rank
                                  writes its own part, nothing is gathered to rank 0
        meta.json              step, tokens, data-loader state, RNG states, the model config, world size, mode
        COMMIT                 written last: every file's size and checksum (see commit.py)
    .step-00000200.partial/   a save in progress (or one that died): never loaded, removed by the next save
    corrupt-step-00000300/    a checkpoint that failed verification, moved aside (kept for inspection)

**Save** (collective: every rank calls ``save``). The state is written into the ``.partial`` directory by DCP,
each rank checksumming the files it writes as it writes them (writer.py); rank 0 gathers the checksums, writes
``meta.json`` and ``COMMIT`` and renames the directory into place. A crash at any point leaves the previous checkpoint as the newest valid one; a
failed save (a full disk, say) removes its partial directory and, by default, lets training go on.
**Async**: the state is first copied into host memory (the only time training waits), then a background thread
does all of the above on its own gloo process group, so its collectives never interleave with training's. At most
one save is in flight; a save that falls due while one is writing waits for it or is skipped (``when_busy``).

**Load**: ``select`` finds the newest checkpoint that passes verification (sizes, and checksums spread over
the ranks); one that fails is reported, moved aside, and the previous one is tried: never a crash loop, never a silent
load of a bad file. If every rank holds a RAM-tier copy of that step (ram_tier.py), ``load`` reads it from host
memory instead of disk. Keys are fully qualified parameter names (``torch.distributed.checkpoint.state_dict``),
so a disk checkpoint loads under another world size or another of DDP / ZeRO-1 / FSDP2.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from zaya.checkpoint.commit import (COMMIT, META, STEP_DIR, FileRecord, checksum_file, checksum_problem,
                                    is_complete, latest_checkpoint, list_checkpoints, new_checksum, read_commit,
                                    read_meta,
                                    share_of_files, size_problem, step_dir_name, write_commit)
from zaya.checkpoint.errors import CheckpointError
from zaya.checkpoint.ram_tier import RamTier, ram_tier_directory
from zaya.checkpoint.staging import copy_into_live, local_view, stage, tensor_bytes
from zaya.checkpoint.writer import ChecksummingWriter
from zaya.config import CheckpointConfig
from zaya.fsutil import atomic_write_bytes, replace_directory, restore_aside

__all__ = ["COMMIT", "META", "CheckpointError", "CheckpointStore", "SaveOutcome", "check_model_config",
           "is_complete", "latest_checkpoint", "list_checkpoints", "read_meta", "step_dir_name"]

_RANK_FILE = re.compile(r"^__(\d+)_")


@dataclass
class SaveOutcome:
    step: int
    ok: bool
    path: Path | None = None
    error: str = ""
    seconds: float = 0.0
    blocked_seconds: float = 0.0
    nbytes: int = 0
    asynchronous: bool = False
    notes: tuple[str, ...] = ()
    """Warnings from the save (e.g. about the RAM tier), logged by the main thread when the outcome is collected."""


def _describe(exc: BaseException, directory: Path | None = None, nbytes: int = 0) -> str:
    """One line for an exception, with a hint for the errors a user can fix. With ``directory``, also the free
    space there: torch's file writers often report a full disk as an opaque RuntimeError."""
    full = str(exc)
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = sorted(failures.items())[0]
        exc = inner
        prefix = f"rank {rank}: " + (f"(and {len(failures) - 1} more rank(s)) " if len(failures) > 1 else "")
    else:
        prefix = ""
    lines = str(exc).strip().splitlines()
    text = prefix + f"{type(exc).__name__}" + (f": {lines[0]}" if lines else "")
    causes = [exc]
    while causes[-1].__cause__ is not None or causes[-1].__context__ is not None:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
        if len(causes) > 8:
            break
    codes = {getattr(c, "errno", None) for c in causes} | {e for e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                                                            if f"[Errno {e}]" in full}
    if directory is not None:
        try:
            free = shutil.disk_usage(directory).free
            text += f" [{free / 2**20:,.0f} MiB free in {directory}]"
            if free < nbytes:
                codes.add(errno.ENOSPC)
        except OSError:
            pass
    if codes & {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}:
        text += " (the filesystem is full or refuses a file this large: free space or point train.run_dir elsewhere)"
    return text


# DCP warns on every single-process save/load that it "assumes" no process group: intended here. A module-level
# filter, because warnings.catch_warnings() is not thread-safe and the background save runs in a thread.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


class CheckpointStore:
    """Saves and loads a run's checkpoints (see the module docstring). Every method is collective."""

    def __init__(self, directory: str | Path, config: CheckpointConfig | None = None, *, rank: int = 0,
                 world_size: int = 1, distributed: bool = False, parallel: str = "ddp",
                 run_dir: str | Path | None = None, log: Callable[[str], None] = print,
                 timeout_s: float = 1800.0):
        self.directory = Path(directory)
        self.config = config or CheckpointConfig()
        self.rank, self.world_size, self.distributed = rank, world_size, distributed
        self.parallel = parallel
        self.log = log
        # Two gloo groups of their own: one for the background save's collectives, one for the main thread's
        # decisions while a save may be in flight. Neither interleaves with training's collectives.
        timeout = timedelta(seconds=timeout_s)
        self._job_pg = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        self._ctl_pg = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        run_dir = Path(run_dir) if run_dir is not None else self.directory.parent
        # The tier's files exist (to clear) even with ram_tier off: a copy an earlier run left must not linger.
        self._ram_files = RamTier(ram_tier_directory(run_dir, self.config.ram_dir), run_dir, rank, world_size,
                                  parallel)
        self.ram = self._ram_files if self.config.ram_tier else None
        self._ram_room_warned = False
        self._staged: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._pending_step = -1  # the step of the save in flight
        self._result: SaveOutcome | None = None
        self._ram_step: int | None = None  # the step select() found in every rank's RAM tier
        self.last_outcome: SaveOutcome | None = None
        self.fatal: SaveOutcome | None = None  # a failed save with on_error = "stop"

    # ------------------------------------------------------------------------------------------- collectives
    def _any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (main thread only)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        return bool(t.item())

    def _gather(self, obj: Any, group) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _broadcast(self, obj: Any, group) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def _barrier(self, group) -> None:
        if self.distributed:
            dist.barrier(group=group)

    # -------------------------------------------------------------------------------------------------- save
    def save(self, step: int, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
             meta: dict[str, Any], blocking: bool | None = None, ram_copy: bool = True) -> SaveOutcome | None:
        """Checkpoint ``step``. Blocking (``blocking=True``, or ``async_save = false``): returns the outcome once
        committed (or failed). Otherwise returns None once the state is staged; the write goes on in the
        background and ``wait`` (or the next save) collects its outcome. Returns None too when the save is
        skipped because the previous one is still writing (``when_busy = "skip"``). ``ram_copy=False`` leaves the
        RAM tier out of this save (a run's final checkpoint: nothing will restart from it in a hurry)."""
        blocking = (not self.config.async_save) if blocking is None else blocking
        meta = copy.deepcopy(meta)  # the caller's loader/RNG state as of now, whatever happens to it meanwhile
        meta["step"] = step
        t0 = time.perf_counter()
        # Every rank takes part, whether or not it still holds a thread: one rank may already have collected its
        # finished save (poll_failed) while another's is still writing.
        busy = self._any(self._thread is not None and self._thread.is_alive())
        if busy and self.config.when_busy == "skip" and not blocking:
            self.log(f"checkpoint at step {step} skipped: the previous save is still writing "
                     '(checkpoint.when_busy = "skip")')
            return None
        if self._thread is not None:
            self.wait()
        model_sd, optim_sd = get_state_dict(model, optimizers, options=StateDictOptions())
        state = {"model": model_sd, "optim": optim_sd}
        nbytes = tensor_bytes(state)
        if blocking:
            outcome = self._write(step, state, meta, ram_copy)
            outcome.nbytes, outcome.seconds = nbytes, time.perf_counter() - t0
            outcome.blocked_seconds = outcome.seconds
            self._settle(outcome)
            return outcome
        self._staged = stage(state, self._staged)
        staged, blocked = self._staged, time.perf_counter() - t0
        self._pending_step = step

        def run() -> None:
            try:
                outcome = self._write(step, staged, meta, ram_copy)
            except BaseException as exc:  # noqa: BLE001 - reported through the outcome, never lost in a thread
                outcome = SaveOutcome(step, False, error=_describe(exc))
            outcome.nbytes, outcome.blocked_seconds, outcome.asynchronous = nbytes, blocked, True
            outcome.seconds = time.perf_counter() - t0
            self._result = outcome

        # Not a daemon: an interpreter that exits (even without close()) first lets the save finish, instead of
        # killing the thread inside torch's writer (which aborts the process). Only a hard kill leaves a partial.
        self._thread = threading.Thread(target=run, name=f"zaya-checkpoint-{step}", daemon=False)
        self._thread.start()
        return None

    def wait(self) -> SaveOutcome | None:
        """Wait for the save in flight (if any) and return its outcome; raises if it failed and
        ``on_error = "stop"``."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        outcome = self._result or SaveOutcome(self._pending_step, False, error="the save thread ended silently")
        self._result = None
        self._settle(outcome)
        return outcome

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

    def _settle(self, outcome: SaveOutcome) -> None:
        self.last_outcome = outcome
        for note in outcome.notes:
            self.log(f"warning: {note}")
        if outcome.ok:
            how = (f"async: training waited {outcome.blocked_seconds:.2f} s" if outcome.asynchronous
                   else "blocking")
            self.log(f"checkpoint {outcome.path} ({outcome.nbytes / 1e6:,.0f} MB, {outcome.seconds:.1f} s, {how})")
            return
        newest = latest_checkpoint(self.directory)
        message = (f"checkpoint of step {outcome.step} failed: {outcome.error}. The newest checkpoint is still "
                   f"{newest or 'none'}")
        if self.config.on_error == "stop":
            self.fatal = outcome
            raise CheckpointError(message + ' (checkpoint.on_error = "stop")')
        self.log(f"warning: {message}; training goes on (set checkpoint.on_error = \"stop\" to stop instead)")

    def _write(self, step: int, state: dict[str, Any], meta: dict[str, Any], ram_copy: bool) -> SaveOutcome:
        """Write, checksum, commit: the collective body of a save (on the job process group)."""
        final = self.directory / step_dir_name(step)
        partial = self.directory / f".{final.name}.partial"
        group = self._job_pg
        error, save_id = None, None
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._recover_leftovers()
                partial.mkdir()
                save_id = uuid.uuid4().hex
            except OSError as exc:
                error = _describe(exc)
        error, save_id = self._broadcast((error, save_id), group)
        if error:
            return SaveOutcome(step, False, error=error)
        meta["save_id"] = save_id  # also in the RAM tier's info: ties a RAM copy to this very save

        local_error, records, pending = None, {}, None
        try:
            writer = ChecksummingWriter(partial, self.config.checksum)
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=not self.distributed)
        except (Exception, CheckpointException) as exc:  # DCP raises on every rank when any rank's write fails
            local_error = _describe(exc, self.directory, tensor_bytes(state))
        if local_error is None:
            try:
                records = self._checksum_own_files(partial, writer.checksums(partial))
            except OSError as exc:
                local_error = _describe(exc)
        notes: list[str] = []
        if self.ram is not None and ram_copy:
            self.ram.invalidate()  # whatever happens next, the copy there now is older than the disk's newest
            if local_error is None:
                pending = self._write_ram(state, step, notes)
        gathered = self._gather((local_error, records), group)

        outcome = SaveOutcome(step, False)
        if self.rank == 0:
            errors = [e for e, _ in gathered if e]
            if errors:
                outcome.error = errors[0]
            else:
                try:
                    outcome = self._commit(step, partial, final, meta, {k: v for _, r in gathered
                                                                        for k, v in r.items()})
                except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks as an outcome
                    outcome.error = _describe(exc)
            if not outcome.ok:
                shutil.rmtree(partial, ignore_errors=True)
        outcome = self._broadcast(outcome, group)
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

    def _write_ram(self, state: dict[str, Any], step: int, notes: list[str]) -> Path | None:
        local = local_view(state)
        nbytes = tensor_bytes(local)
        try:
            if not self.ram.room_for(nbytes):
                if not self._ram_room_warned:
                    notes.append(f"{self.ram.directory.parent} has no room for a {nbytes / 2**20:.0f} MiB RAM tier "
                                 "copy; restarts will load from disk (set checkpoint.ram_dir, or ram_tier = false)")
                    self._ram_room_warned = True
                return None
            return self.ram.write_pending(local, step)
        except Exception as exc:  # noqa: BLE001 - the RAM tier is an optimisation: never fail a save
            notes.append(f"RAM tier copy of step {step} failed ({_describe(exc)}); restarts load from disk")
            return None

    def _commit(self, step: int, partial: Path, final: Path, meta: dict[str, Any],
                records: dict[str, FileRecord]) -> SaveOutcome:
        body = (json.dumps(meta, indent=1) + "\n").encode()
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
        """Finish the save in flight (a process that exits normally never abandons one)."""
        self.wait_quietly()

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
        records = read_commit(path)
        problem = size_problem(path, records)
        if problem is None and self.config.verify == "checksum":
            problem = checksum_problem(path, share_of_files(records, self.rank, self.world_size), records)
        problems = [p for p in self._gather(problem, self._ctl_pg) if p]
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
        that passes verification; failures are reported and moved aside) or a path (a run directory or one
        checkpoint; it must pass verification)."""
        self._ram_step = None
        if self.rank == 0:
            self._recover_leftovers()
        self._barrier(self._ctl_pg)
        if resume == "never":
            self.forget_ram_tier()
            return None
        if resume != "auto":
            path = Path(resume)
            if (path / "checkpoints").is_dir():
                newest = latest_checkpoint(path / "checkpoints")
                if newest is None:
                    raise CheckpointError(f"{resume}: no complete checkpoint in {path / 'checkpoints'}")
                path = newest
            problem = self._verify(path)
            if problem is not None:
                done = [p for p in list_checkpoints(path.parent) if p != path]
                hint = f"; the newest other complete one is {done[-1]}" if done else ""
                raise CheckpointError(f"{path}: cannot be loaded: {problem}{hint}")
            self._abandon_newer_than(path)
            return path

        candidates = self._broadcast([str(p) for p in list_checkpoints(self.directory)], self._ctl_pg)
        for name in reversed(candidates):
            path = Path(name)
            step = int(STEP_DIR.match(path.name).group(1))
            if self.ram is not None and not self._any(not self.ram.holds(step, _save_id(path),
                                                                         self.config.ram_verify)):
                self._ram_step = step
                return path
            problem = self._verify(path)
            if problem is None:
                return path
            if self.rank == 0:
                aside = self._move_aside(path, "corrupt")
                self.log(f"warning: checkpoint {path} failed verification ({problem}); moved to {aside}, trying "
                         "the previous one")
            self._barrier(self._ctl_pg)
        self.forget_ram_tier()  # nothing to resume: a copy there belongs to something else
        return None

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
        self._barrier(self._ctl_pg)

    def load(self, path: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer] | None) -> dict:
        """Load model (and optimizer) state from ``path`` (or from the RAM tier, when ``select`` found every rank
        holding that step) into the live objects; returns the checkpoint's meta. Collective."""
        meta = read_meta(path)
        # Hyperparameters come from the config, not the file: a DCP round trip keeps only the state tensors
        # reliably (e.g. a torch.dtype group option does not survive), and the config may legitimately change.
        hyper = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                 for opt in optimizers or []]
        model_sd, optim_sd = get_state_dict(model, optimizers or [], options=StateDictOptions())
        from_ram = self._ram_step is not None and self._ram_step == meta["step"] and self.ram is not None
        state = None
        if from_ram:
            # Read every rank's copy first and agree: a copy that cannot be read (it was checked by size and
            # save_id, and by crc32 with ram_verify) sends every rank to the disk, never into a crash loop.
            try:
                saved, error = self.ram.read(), None
            except Exception as exc:  # noqa: BLE001 - any unreadable copy means disk
                saved, error = None, exc
            if self._any(error is not None):
                from_ram = False
                if error is not None:
                    self.log(f"warning: RAM tier copy {self.ram.data_path} cannot be read ({_describe(error)}); "
                             "loading from disk")
                self.forget_ram_tier()
                problem = self._verify(path)  # select skipped it because the RAM copy was to be used
                if problem is not None:
                    raise CheckpointError(f"{path}: cannot be loaded: {problem}")
            else:
                with torch.no_grad():
                    state = {"model": copy_into_live(saved["model"], model_sd)}
                    if optimizers:
                        state["optim"] = copy_into_live(saved["optim"], optim_sd)
                del saved  # drop the file mapping
        if state is None:
            check_tensor_shapes(path, model_sd)
            state = {"model": model_sd}
            if optimizers:
                state["optim"] = optim_sd
            dcp.load(state, checkpoint_id=str(path), process_group=self._ctl_pg, no_dist=not self.distributed)
        if optimizers:
            set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
            for opt, groups in zip(optimizers, hyper):
                for group, saved_group in zip(opt.param_groups, groups):
                    group.update(saved_group)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, state["model"])
        meta["loaded_from"] = "ram" if from_ram else "disk"
        return meta


def _save_id(path: Path) -> str | None:
    try:
        return json.loads((path / META).read_text()).get("save_id")
    except (OSError, ValueError, AttributeError):
        return None


def check_tensor_shapes(path: Path, model_sd: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model tensors differ from the live model's, naming the first one."""
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - an unreadable .metadata is a corrupt checkpoint
        raise CheckpointError(f"{path}/.metadata cannot be read ({exc})") from None
    for name, tensor in model_sd.items():
        entry = saved.get(f"model.{name}")
        if entry is None:
            raise CheckpointError(f"{path}: has no tensor model.{name}: made for a different model")
        shape = tuple(getattr(entry, "size", ()))
        if shape != tuple(tensor.shape):
            raise CheckpointError(f"{path}: tensor model.{name} has shape {list(shape)} there, "
                                  f"{list(tensor.shape)} in this model: made for a different model")


def check_model_config(meta: dict[str, Any], model_config: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint made for another model shape, naming the first differing key."""
    saved = meta.get("model_config", {})
    for key in sorted(set(saved) | set(model_config)):
        if saved.get(key) != model_config.get(key):
            raise CheckpointError(f"{path}: made for a different model: model.{key} = {saved.get(key)!r} there, "
                                  f"{model_config.get(key)!r} here (use --resume never or a new --run-dir to "
                                  "start fresh)")
