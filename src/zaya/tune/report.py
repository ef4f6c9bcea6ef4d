"""What every tune command does around its measurement: options -> measure -> a result dict -> its text or one JSON
line, the files it writes (the result's JSON, a PNG) and, unless ``--no-save``, the hardware profile.

The profile is only written here (``save_to_profile``); ``zaya.core.hardware`` reads it for everyone else.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any, Callable

DEFAULT_OUT = "runs/tune"


def add_output_arguments(p: argparse.ArgumentParser, files: str, picture: str) -> None:
    """``--out`` (where ``files`` go), ``--no-save`` (the profile), ``--no-plot`` (``picture``) and ``--json``."""
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"where {files} go (default {DEFAULT_OUT})")
    p.add_argument("--no-save", action="store_true", help="do not write the hardware profile")
    p.add_argument("--no-plot", action="store_true", help=f"do not write {picture}")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON line")


def command_line(verb: str) -> str:
    """The command as typed ("zaya tune gemm --quick"), or just ``verb`` when not run as that zaya command."""
    words = verb.split()
    argv = sys.argv[1:]
    return " ".join(["zaya", *argv]) if argv[:len(words) - 1] == words[1:] else verb


def now() -> str:
    """When a result was measured: UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def progress(quiet: bool = False) -> Callable[[str], None]:
    """A progress line writer: stderr, flushed (stdout keeps the report or the JSON line); nothing when ``quiet``."""
    if quiet:
        return lambda msg: None
    return lambda msg: print(msg, file=sys.stderr, flush=True)


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """The whole result, indented, written atomically."""
    from zaya.core.fsutil import atomic_write_text

    atomic_write_text(path, json.dumps(result, indent=1) + "\n")


def figure(width: float, height: float) -> Any:
    """A matplotlib Figure on the Agg canvas (no pyplot, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def write_png(fig: Any, path: str | Path, dpi: int) -> None:
    """``fig`` as a PNG on a white background, written atomically."""
    import io

    from zaya.core.fsutil import atomic_write_bytes

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    atomic_write_bytes(path, buffer.getvalue())


def save_to_profile(device: Any, **values: Any) -> str:
    """Write ``values`` into ``device``'s hardware profile, its other fields kept; the file's path."""
    from zaya.core.hardware import update_profile

    return str(update_profile(device, **values))


def emit(result: dict[str, Any], as_json: bool, text: Callable[[dict[str, Any]], str]) -> int:
    """Print the result: one JSON line, or ``text(result)``; 0, the command's exit status."""
    print(json.dumps(result) if as_json else text(result))
    return 0


def rate(tflops: float | None) -> str:
    """A FLOP/s figure given in TFLOP/s, in TFLOP/s from 1 up and in GFLOP/s below; "-" for none."""
    if not tflops:
        return "-"
    return f"{tflops:.3g} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.3g} GFLOP/s"
