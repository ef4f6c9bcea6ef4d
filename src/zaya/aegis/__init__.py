"""Aegis: the supervisor of ``zaya run``. It launches training through torchrun, watches it (per-rank heartbeats,
exit codes, output, kernel and other logs, system metrics), diagnoses faults with small rules that cite their
evidence, repairs them as the ``[aegis]`` policy table says, and records every decision in ``events.jsonl``.

One concern per module: ``heartbeat`` (the trainer callback and its reader), ``directives`` (the trainer side of a
rewind: skipped batches, a temporary LR cut), ``detectors`` (the rules), ``policy`` (finding -> action, repeat
limits), ``sources`` (logs, kernel log, psutil/NVML/amd-smi), ``supervisor`` (the launch/watch/act loop),
``events`` (events.jsonl and ``zaya aegis report``), ``chaos`` (fault injection), ``standby`` (the next attempt,
started ahead), ``lineage`` (the job ends with its supervisor; pids checked before they are trusted).
docs/operations.md is the guide.
"""

from __future__ import annotations

import os
from pathlib import Path

AEGIS_DIR_ENV = "ZAYA_AEGIS_DIR"
"""Set by the supervisor for every rank: the directory where heartbeats, directives and events live."""
ATTEMPT_ENV = "ZAYA_AEGIS_ATTEMPT"
"""Set by the supervisor: which launch of the job this is (0 first, then one more per relaunch)."""
CHAOS_ENV = "ZAYA_CHAOS"
"""A chaos plan file (JSON); when set, the trainer injects the faults it lists (``zaya.aegis.chaos``)."""


def aegis_dir(run_dir: str | Path) -> Path:
    """Where Aegis keeps its files inside a run directory."""
    return Path(run_dir) / "aegis"


def trainer_callbacks() -> list:
    """The callbacks a supervised rank runs (none outside ``zaya run``): heartbeats, the rewind directives and,
    with ``ZAYA_CHAOS`` set, fault injection. ``zaya train`` passes them to the trainer's callbacks list. Under a
    supervisor it also starts the watch that stops this rank, with a checkpoint, if the supervisor dies
    (``zaya.aegis.lineage``)."""
    where = os.environ.get(AEGIS_DIR_ENV)
    if not where and not os.environ.get(CHAOS_ENV):
        return []
    from zaya.aegis.chaos import ChaosHook
    from zaya.aegis.directives import Directives
    from zaya.aegis.heartbeat import Heartbeat
    from zaya.aegis.lineage import watch_supervisor

    out: list = []
    if where:
        watch_supervisor()
        out += [Heartbeat(Path(where)), Directives(Path(where))]
    if os.environ.get(CHAOS_ENV):
        out.append(ChaosHook.from_env())
    return out
