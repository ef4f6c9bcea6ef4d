"""Start-up checks that the ranks of a job see the same files, so that a missing shared filesystem fails at once
with a message that says what must be shared, instead of late and obscurely (a checkpoint whose shards landed on
different nodes, a rank that reads another dataset than rank 0).

* ``check_shared_directory``: rank 0 writes a marker with a random token into a directory (the run directory);
  every rank reads it back.
* ``check_same_datasets``: every rank opened the datasets itself; their content fingerprints
  (``PreparedDataset.fingerprint``: the bundles' and tokenizer's sha256) must agree with rank 0's.

Both are collective, and raise the same error on every rank.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from zaya.distributed.runtime import Runtime
from zaya.core.errors import ConfigError, DataError

MARKER_PREFIX = ".zaya-shared-check-"


def _ranks_text(rows: list[tuple[int, str, str]]) -> str:
    """'ranks 2, 3 (host b: reason)' for a list of (rank, host, reason)."""
    by_host: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for rank, host, reason in rows:
        by_host.setdefault(host, []).append(rank)
        reasons.setdefault(host, reason)
    parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} on {host} ({reasons[host]})"
             for host, r in by_host.items()]
    return "; ".join(parts)


def check_shared_directory(rt: Runtime, directory: Path, key: str) -> None:
    """Every rank must see the directory rank 0 writes to (``key`` names the config key that sets it)."""
    if not rt.distributed:
        return
    token, error = None, None
    if rt.is_main:
        token = uuid.uuid4().hex
        try:
            marker = directory / f"{MARKER_PREFIX}{token}"
            marker.write_text(f"{token} {rt.hostname} {os.getpid()}\n")
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    token, error = rt.broadcast_object((token, error))
    if error is not None:
        raise ConfigError(f"{key} = {directory}: rank 0 cannot write there ({error})")
    marker = directory / f"{MARKER_PREFIX}{token}"
    try:
        seen = marker.read_text().split()[0] == token
        reason = "" if seen else "the marker holds another token"
    except OSError as exc:
        seen, reason = False, f"{type(exc).__name__}: {exc.strerror or exc}"
    rows = rt.all_gather_object((rt.rank, rt.hostname, reason if not seen else None))
    if rt.is_main:
        marker.unlink(missing_ok=True)
    missing = [(r, h, why) for r, h, why in rows if why is not None]
    if missing:
        host0 = rows[0][1]
        raise ConfigError(
            f"{key} = {directory} is not shared: rank 0 (on {host0}) wrote a marker file there that "
            f"{_ranks_text(missing)} cannot read. Every rank writes checkpoint shards, and reads the config and "
            f"the checkpoints, in that directory: put {key} on a filesystem that every node mounts at the same path "
            "(NFS, Lustre, GPFS, ...)")


def check_same_datasets(rt: Runtime, fingerprints: dict[str, str] | None, error: str | None,
                        node_local: bool) -> None:
    """Every rank opened the datasets (``fingerprints``: name -> content fingerprint) or failed (``error``);
    all must have succeeded with rank 0's fingerprints."""
    if not rt.distributed:
        if error is not None:
            raise DataError(error)
        return
    rows = rt.all_gather_object((rt.rank, rt.hostname, fingerprints, error))
    failed = [(r, h, e) for r, h, _, e in rows if e is not None]
    how = ("each node resolved data.datasets itself (data.node_local = true)" if node_local else
           "rank 0 resolved data.datasets and every rank opened the same directories")
    if failed:
        hint = ("" if node_local else "; put the datasets (and data.cache_dir for builtin corpora) on a filesystem "
                "every node mounts, or set data.node_local = true to prepare/resolve them on every node")
        raise DataError(f"the datasets cannot be opened by {_ranks_text(failed)}; {how}{hint}")
    reference = rows[0][2]
    differ = [(r, h, ", ".join(sorted(n for n in reference if (fp or {}).get(n) != reference[n])))
              for r, h, fp, _ in rows if fp != reference]
    if differ:
        raise DataError(f"the datasets differ between ranks: {_ranks_text(differ)} hold other contents than rank "
                        f"0's (their bundles' or tokenizer's sha256 differ); {how}. Every rank must train on the "
                        "same data: prepare it once and share it, or give every node an identical copy")
