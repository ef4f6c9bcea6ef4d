"""Resolve dataset names in a config to prepared directories, preparing built-in corpora once and caching them.

``builtin:shakespeare`` becomes ``<cache>/datasets/shakespeare-bpe<vocab>-v<format>``, prepared on first use. A
file lock serialises concurrent preparers (several ranks, or two runs started together): the first prepares, the
others wait and then find it ready. The cache lives in ``$ZAYA_CACHE_DIR``, else ``~/.cache/zaya``.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable

from zaya.data.bundle import DATASET_VERSION, MANIFEST, DatasetError
from zaya.data.sources import BUILTIN
from zaya.core.errors import writing
from zaya.core.fsutil import cache_root

BUILTIN_VAL_FRACTION = 0.05
ELSEWHERE = "set ZAYA_CACHE_DIR to a directory on a disk with room"
"""The fix a full disk in the cache names, beside freeing space."""


def builtin_dataset_dir(spec: str, vocab_size: int, cache_dir: str | Path | None = None) -> Path:
    name = spec.split(":", 1)[1]
    return cache_root(cache_dir) / "datasets" / f"{name}-bpe{vocab_size}-v{DATASET_VERSION}"


def resolve_dataset(spec: str, vocab_size: int = 4096, cache_dir: str | Path | None = None,
                    log: Callable[[str], None] = print) -> Path:
    """A prepared dataset directory for ``spec`` (a directory, or a ``builtin:`` corpus, prepared if needed)."""
    if not spec.startswith("builtin:"):
        path = Path(spec).expanduser()
        if not (path / MANIFEST).is_file():
            raise DatasetError(f"data.datasets: {spec!r} is not a prepared dataset (no {path / MANIFEST}); "
                               "create it with `zaya data prepare --input ... --out DIR`")
        return path
    if spec not in BUILTIN:
        raise DatasetError(f"data.datasets: unknown built-in corpus {spec!r}; available: {', '.join(BUILTIN)}")
    out = builtin_dataset_dir(spec, vocab_size, cache_dir)
    if (out / MANIFEST).is_file():
        return out
    with writing(out.parent, f"preparing {spec} in zaya's cache", ELSEWHERE):
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.parent / f".{out.name}.lock", "w")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / MANIFEST).is_file():  # another process prepared it while we waited
            return out
        from zaya.data.prepare import PrepareOptions, prepare

        log(f"preparing {spec} (first use; cached in {out})")
        result = prepare(PrepareOptions(inputs=[spec], out=str(out), vocab_size=vocab_size,
                                        val_fraction=BUILTIN_VAL_FRACTION, force=out.exists()), log=log,
                         elsewhere=ELSEWHERE)
        log(f"prepared {spec}: {result.manifest['splits']['train']['tokens']:,} train tokens in "
            f"{result.seconds:.1f} s")
    return out
