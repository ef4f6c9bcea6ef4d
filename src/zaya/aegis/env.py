"""The names a supervisor and its ranks share: the environment variables it sets and where its files live."""

from __future__ import annotations

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
