"""``metrics.jsonl``: a run's record of every step and evaluation, written and read here only.

One JSON object per line, appended and flushed as it happens: a crash loses at most the line being written, and the
writer cuts such a torn line before it appends again. Records have a ``kind`` ("train" every logged step, "val"
every evaluation; other kinds may come) and an integer ``step``. A resumed run writes its steps again: reading
resolves that once, here, so that a step's later record wins (``latest_wins``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

from zaya.core.fsutil import loads_json
from zaya.core.layout import METRICS_FILE

KINDS = ("train", "val")


def drop_torn_line(path: Path) -> None:
    """Cut a half-written last line (a crash mid-write) so the next record starts on a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - 1))
        if fh.read(1) == b"\n":
            return
        data_end = size
        block = 1 << 16
        while data_end > 0:
            start = max(0, data_end - block)
            fh.seek(start)
            chunk = fh.read(data_end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                fh.truncate(start + cut + 1)
                return
            data_end = start
        fh.truncate(0)


class MetricsWriter:
    """Appends records to one metrics file, a flushed line each (non-finite floats as NaN/Infinity)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        drop_torn_line(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, allow_nan=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def step_of(record: dict[str, Any]) -> int | None:
    """A record's step as an int (a whole float counts); None when it has none."""
    step = record.get("step")
    if isinstance(step, float) and step.is_integer():
        return int(step)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def parse_records(data: bytes, where: str | Path = METRICS_FILE, strict: bool = False
                  ) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
    """``(line number, line, record)`` for each line of ``data`` that is a JSON object, in order. A line that is not
    is skipped; with ``strict`` only the last one (a torn write: skipped with a warning), any other is a ValueError
    naming ``where`` and the line."""
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip(b" \t\r\x00")), default=-1)
    for index, raw in enumerate(lines[:last + 1]):
        if not raw.strip(b" \t\r\x00"):
            continue
        try:
            record = loads_json(raw)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as err:  # not JSON, not UTF-8, or nested past the parser's depth
            if not strict:
                continue
            if index == last:
                warnings.warn(f"{where}:{index + 1}: skipped an incomplete last line (a crash or a write in "
                              f"progress): {clip(raw)}", stacklevel=3)
                return
            raise ValueError(f"{where}:{index + 1}: not a JSON object ({err}): {clip(raw)}") from None
        yield index + 1, raw, record


def stepped_records(data: bytes) -> list[dict[str, Any]]:
    """Every record in ``data`` with an integer step (of any kind), in order, skipping any other line: what a reader
    of a file still being written (the supervisor's tail of it) can use."""
    out = []
    for _, _, record in parse_records(data):
        step = step_of(record)
        if step is not None:
            record["step"] = step
            out.append(record)
    return out


def latest_wins(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kept timeline of one kind's records (in file order, integer steps): a record whose step is at or below
    the one before it was written by a resumed run, and drops the earlier records from its step on."""
    kept: list[dict[str, Any]] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


def read_metrics(path: str | Path, kinds: Iterable[str] = KINDS, strict: bool = False) -> dict[str, list[dict]]:
    """The records of each of ``kinds`` in the metrics file ``path``, by kind, each the kept timeline
    (``latest_wins``) with integer steps. Lines of other kinds are ignored. Lenient by default (a line that is not a
    record is skipped); ``strict`` refuses one, as ``parse_records`` does, and a record of ``kinds`` without an
    integer step (ValueError naming the file and line). OSError when the file cannot be read."""
    path = Path(path)
    found: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for lineno, raw, record in parse_records(path.read_bytes(), path, strict):
        kind = record.get("kind")
        if kind not in found:
            continue
        step = step_of(record)
        if step is None:
            if strict:
                raise ValueError(f"{path}:{lineno}: {kind} record without an integer 'step': {clip(raw)}")
            continue
        record["step"] = step
        found[kind].append(record)
    return {kind: latest_wins(records) for kind, records in found.items()}


def clip(raw: bytes, limit: int = 80) -> str:
    """A line as an error message shows it: decoded, cut at ``limit`` characters, quoted."""
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")
