"""The heatmap PNG of ``zaya tune gemm``: achieved throughput, one panel per GEMM kind, width x tokens."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zaya.tune.gemm.shapes import KINDS
from zaya.tune.gemm.text import grid, unit
from zaya.tune.report import figure, write_png


def plot(result: dict[str, Any], dtype: str, path: Path, title: str) -> None:
    """Heatmap of achieved throughput: one panel per GEMM kind, width x tokens, one colour scale."""
    import numpy as np

    cells = grid(result, dtype)
    name, scale = unit(c["tflops"] or 0 for k in cells.values() for row in k.values() for c in row.values())
    tokens = result["tokens"]
    vmax = max((c["tflops"] or 0) * scale for k in cells.values() for row in k.values() for c in row.values()) or 1
    cols = min(4, len(cells))
    nrows = math.ceil(len(cells) / cols)
    fig = figure(3.1 * cols + 0.8, 0.42 * len(result["widths"]) * nrows + 1.2 * nrows + 0.6)
    image = None
    for i, (kind, rows) in enumerate(cells.items()):
        ax = fig.add_subplot(nrows, cols, i + 1)
        widths = sorted(rows)
        data = np.array([[(rows[w].get(t, {}).get("tflops") or np.nan) * scale for t in tokens] for w in widths])
        image = ax.imshow(data, cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
        for (y, x), v in np.ndenumerate(data):
            if np.isfinite(v):
                ax.text(x, y, f"{v:.3g}", ha="center", va="center", fontsize=6,
                        color="white" if v < 0.6 * vmax else "black")
        ax.set_xticks(range(len(tokens)), [f"{t:,}" for t in tokens], fontsize=6)
        labels = []
        for w in widths:
            c = next(iter(rows[w].values()))
            labels.append(f"{w}: {c['n']}x{c['k']}" + (f"/{c['groups']}" if c["groups"] > 1 else ""))
        ax.set_yticks(range(len(widths)), labels, fontsize=6)
        ax.set_title(f"{kind} ({KINDS[kind]})", fontsize=7)
        ax.set_xlabel("tokens per micro-batch", fontsize=6)
        if i % cols == 0:
            ax.set_ylabel("hidden size: N x K", fontsize=6)
    if image is not None:
        bar = fig.colorbar(image, ax=fig.axes, shrink=0.8)
        bar.set_label(f"achieved {name}", fontsize=7)
        bar.ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=8)
    write_png(fig, path, dpi=120)
