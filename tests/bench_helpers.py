"""Running a benchmark script the way ``python benchmarks/SCRIPT ARGS`` does, in the test's own process: no second
interpreter importing torch and transformers, so a smoke test of a benchmark costs its work, not a start-up."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(monkeypatch, capsys, script: str, *args: str) -> list[dict]:
    """Run ``benchmarks/<script>`` as ``__main__`` from the repository root with ``args``; ``sys.argv``,
    ``sys.path`` (scripts put their own folders first) and torch's thread count (scripts set theirs) are restored
    after. A ``SystemExit`` other than 0 fails with the script's output. Returns its stdout's JSON lines."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            out = capsys.readouterr()
            raise AssertionError(f"{script} exited with {done.code}: {out.err[-3000:]}{out.out[-2000:]}") from None
    finally:
        torch.set_num_threads(threads)
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
