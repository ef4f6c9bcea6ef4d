"""Aegis: the supervisor of ``zaya run``. It launches training through torchrun, watches it (per-rank heartbeats,
exit codes, output, kernel and other logs, system metrics), diagnoses faults with small rules that cite their
evidence, repairs them as the ``[aegis]`` policy table says, and records every decision in ``events.jsonl``.

One concern per module: ``heartbeat`` (the trainer callback and its reader), ``directives`` (the trainer side of a
rewind: skipped batches, a temporary LR cut), ``detectors`` (the rules), ``policy`` (finding -> action, repeat
limits), ``sources`` (logs, kernel log, psutil/NVML/amd-smi), ``supervisor`` (the launch/watch/act loop),
``events`` (events.jsonl and ``zaya aegis report``), ``chaos`` (fault injection), ``standby`` (the next attempt,
started ahead), ``lineage`` (the job ends with its supervisor; pids checked before they are trusted), ``env`` (the environment
variables and paths a supervisor and its ranks share).
docs/operations.md is the guide.
"""

from __future__ import annotations

import os
from pathlib import Path

from zaya.aegis.env import AEGIS_DIR_ENV, CHAOS_ENV


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
