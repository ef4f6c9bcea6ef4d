"""Plots of a training run: read ``<run_dir>/metrics.jsonl`` and write PNGs to ``<run_dir>/plots/``.

``read_metrics`` reads the file strictly (``zaya.core.metrics_file``): a torn last line is skipped with a warning,
any other line that is not a record is an error naming the file and line, and a resumed step's later record wins.

``plot_run`` writes ``loss.png``, ``lr.png``, ``throughput.png``, ``expert_load.png`` (the heatmap of each
router class's share per step) and ``routing.png`` (per layer: max/mean load, its coefficient of variation, the
load entropy, the probe's flip rate and token entropy, the skip share). It draws on Agg figures made here
(``matplotlib.figure.Figure`` + ``FigureCanvasAgg``) and never touches pyplot, so it neither needs a display nor
changes the backend of a program that imports it. Each PNG is written atomically.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from zaya.core import metrics_file
from zaya.core.fsutil import atomic_write_bytes
from zaya.core.layout import metrics_path, plots_dir
from zaya.core.units import format_count

PLOT_FILES = ("loss.png", "lr.png", "throughput.png", "expert_load.png", "routing.png")

_DPI = 110
_MAX_HEATMAP_COLUMNS = 300  # time bins per expert-load panel; longer runs are averaged into this many


# ----------------------------------------------------------------------------------------------------------------
# Reading


def read_metrics(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train_records, val_records)`` of ``<run_dir>/metrics.jsonl``, each sorted by step with resumes resolved.

    ``run_dir`` may also be the metrics file itself. Raises ``ValueError`` (naming the path) when the file is missing,
    when a line other than the last is not a JSON object, or when a train/val record has no integer ``step``.
    """
    path = _metrics_path(run_dir)
    if not path.is_file():
        raise ValueError(f"no metrics file at {path} (the trainer writes it as the run goes)")
    kept = metrics_file.read_metrics(path, strict=True)
    return kept["train"], kept["val"]


def _metrics_path(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    return path if path.suffix == ".jsonl" and not path.is_dir() else metrics_path(path)


# ----------------------------------------------------------------------------------------------------------------
# Plotting


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write loss/lr/throughput/expert-load/routing PNGs of a run to ``out_dir`` (default ``<run_dir>/plots``).

    Returns the written paths in the order of ``PLOT_FILES``. A metric the run never logged gives a figure that says
    so, so a directory of plots never mixes in stale files of an earlier run. ``ValueError`` (naming the path) when
    the metrics file is missing or holds no train records.
    """
    train, val = read_metrics(run_dir)
    if not train:
        raise ValueError(f"{_metrics_path(run_dir)} holds no train records yet")
    run_dir = Path(run_dir)
    if out_dir is None:
        base = run_dir.parent if _metrics_path(run_dir) == run_dir else run_dir
        out_dir = plots_dir(base)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    run = _Run(train, val, name=_run_name(run_dir))
    makers = {"loss.png": _plot_loss, "lr.png": _plot_lr, "throughput.png": _plot_throughput,
              "expert_load.png": _plot_expert_load, "routing.png": _plot_routing}
    written = []
    for name in PLOT_FILES:
        fig = makers[name](run)
        path = out_dir / name
        _save(fig, path)
        written.append(path)
    return written


def _run_name(run_dir: Path) -> str:
    path = run_dir.resolve()
    return path.parent.name if path.suffix == ".jsonl" else path.name


def _save(fig: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # Agg for this figure only; pyplot and the global backend are never touched
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI, facecolor="white")
    atomic_write_bytes(path, buffer.getvalue())


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _column(records: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    """``records[i][key]`` as floats, NaN where missing, null or not a number."""
    out = np.full(len(records), np.nan)
    for i, record in enumerate(records):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[i] = value
    return out


class _Run:
    """Columns of a run shared by the figures, and its x axis: tokens when every train record has them, else step."""

    def __init__(self, train: list[dict[str, Any]], val: list[dict[str, Any]], name: str):
        self.train, self.val, self.name = train, val, name
        self.step = _column(train, "step")
        tokens = _column(train, "tokens")
        self.by_tokens = bool(np.all(np.isfinite(tokens)))
        self.x = tokens if self.by_tokens else self.step
        self.xlabel = "tokens" if self.by_tokens else "step"
        self.stages = _fill_stages(train)
        self.skipped = np.array([r.get("skipped") is True for r in train], dtype=bool)

    def val_xy(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        y = _column(self.val, key)
        if not self.by_tokens:
            return _column(self.val, "step"), y
        x = _column(self.val, "tokens")
        missing = ~np.isfinite(x)
        if missing.any():  # a val record without tokens: the tokens of its step, from the train records
            x[missing] = np.interp(_column(self.val, "step")[missing], self.step, self.x)
        return x, y

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(x, ``key``) of the train records, skipped steps left out (they log no lr, throughput, ...)."""
        keep = ~self.skipped
        return self.x[keep], _column(self.train, key)[keep]

    def segments(self) -> list[tuple[int, str]]:
        """(index of the first train record, stage) of every run of equal ``stage`` values."""
        return [(i, s) for i, s in enumerate(self.stages) if i == 0 or s != self.stages[i - 1]]

    def title(self, what: str) -> str:
        return f"{self.name}: {what}" if self.name else what


def _fill_stages(train: Sequence[dict[str, Any]]) -> list[str]:
    """Each record's ``stage``; a record without one (a skipped step's) takes the stage of the record before it."""
    stages: list[str | None] = []
    current = None
    for record in train:
        if isinstance(record.get("stage"), str):
            current = record["stage"]
        stages.append(current)
    first = next((stage for stage in stages if stage is not None), "")
    return [first if stage is None else stage for stage in stages]


def _format_axis(ax: Any, run: _Run) -> None:
    ax.set_xlabel(run.xlabel)
    if run.by_tokens:
        ax.xaxis.set_major_formatter(_count_formatter())
    ax.grid(True, alpha=0.3)


def _count_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _pos: format_count(value, 4))


def _draw_stages(ax: Any, run: _Run, x: np.ndarray | None = None, label: bool = True, color: str = "0.35") -> None:
    """Dashed vertical lines where ``stage`` changes, each labelled with the stage that starts there."""
    segments = run.segments()
    if len(segments) < 2:
        return
    x = run.x if x is None else x
    transform = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for n, (i, stage) in enumerate(segments):
        if n > 0:
            ax.axvline(x[i], color=color, linestyle="--", linewidth=1.0, alpha=0.8, zorder=1)
        if label:
            ax.annotate(stage, xy=(x[i], 0.98), xycoords=transform, xytext=(2, 0), textcoords="offset points",
                        rotation=90, ha="left", va="top", fontsize=8, color=color, annotation_clip=True)


def _no_data(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _ema(y: np.ndarray, span: float) -> np.ndarray:
    """Bias-corrected exponential moving average that steps over NaNs."""
    beta = 1.0 - 1.0 / max(span, 1.0)
    out = np.full_like(y, np.nan)
    acc = weight = 0.0
    for i, value in enumerate(y):
        if math.isfinite(value):
            acc = beta * acc + (1 - beta) * value
            weight = beta * weight + (1 - beta)
        if weight > 0:
            out[i] = acc / weight
    return out


def _finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]


def _plot_loss(run: _Run) -> Any:
    fig = _figure(9, 5)
    ax = fig.add_subplot()
    loss = _column(run.train, "loss")
    n = len(loss)
    smoothed = n >= 20
    if smoothed:
        ema = _ema(loss, span=max(2.0, n / 50))
        ax.plot(run.x, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss")
        ax.plot(run.x, ema, color="tab:blue", linewidth=1.8, label="train loss (EMA)")
    else:
        ax.plot(run.x, loss, color="tab:blue", marker="o", markersize=3, linewidth=1.5, label="train loss")
    vx, vy = run.val_xy("val_loss")
    if np.isfinite(vy).any():
        ax.plot(vx, vy, color="tab:orange", marker="o", markersize=5, linewidth=1.0, linestyle=":",
                label="validation loss", zorder=3)
    if run.skipped.any():  # steps dropped for a non-finite loss or gradient: crosses along the bottom
        ax.plot(run.x[run.skipped], np.full(int(run.skipped.sum()), 0.02), transform=ax.get_xaxis_transform(),
                linestyle="none", marker="x", color="tab:red", label=f"skipped step ({int(run.skipped.sum())})")
    _format_axis(ax, run)
    ax.set_ylabel("loss (nats/token)")
    _step_axis(ax, run)
    _draw_stages(ax, run)
    fig.legend(loc="outside lower center", ncols=4, frameon=False)  # keeps the curves and stage labels clear

    parts = [f"step {int(run.step[-1]):,}"]
    last = _finite(ema if smoothed else loss)
    if last.size:
        parts.append(f"train {last[-1]:.4f}" + (" (EMA)" if smoothed else ""))
    if _finite(vy).size:
        parts.append(f"val {_finite(vy)[-1]:.4f} (best {np.nanmin(vy):.4f})")
    ax.set_title(run.title("loss") + "\n" + ", ".join(parts), fontsize=11)
    return fig


def _step_axis(ax: Any, run: _Run) -> None:
    """A secondary x axis with steps on top of a tokens axis (piecewise linear between logged steps)."""
    if not run.by_tokens or len(run.x) < 2 or not np.all(np.diff(run.x) > 0) or not np.all(np.diff(run.step) > 0):
        return
    tokens, steps = run.x, run.step

    def extrapolating(xs: np.ndarray, ys: np.ndarray):
        lo = (ys[1] - ys[0]) / (xs[1] - xs[0])
        hi = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

        def f(v):
            v = np.asarray(v, dtype=float)
            out = np.interp(v, xs, ys)
            out = np.where(v < xs[0], ys[0] + (v - xs[0]) * lo, out)
            return np.where(v > xs[-1], ys[-1] + (v - xs[-1]) * hi, out)
        return f

    top = ax.secondary_xaxis("top", functions=(extrapolating(tokens, steps), extrapolating(steps, tokens)))
    top.set_xlabel("step", fontsize=9)
    top.tick_params(labelsize=8)


def _plot_lr(run: _Run) -> Any:
    x, lr = run.series("lr")
    _, grad = run.series("grad_norm")
    has_grad = np.isfinite(grad).any()
    fig = _figure(9, 6 if has_grad else 4)
    axes = fig.subplots(2 if has_grad else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    if np.isfinite(lr).any():
        ax.plot(x, lr, color="tab:green", linewidth=1.5)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useMathText=True)
        peak = np.nanmax(lr)
        ax.set_title(run.title("learning rate") + f"\npeak {peak:.3g}, last {_finite(lr)[-1]:.3g}", fontsize=11)
    else:
        ax.set_title(run.title("learning rate"), fontsize=11)
        _no_data(ax, "no 'lr' in the train records")
    ax.set_ylabel("learning rate")
    _format_axis(ax, run)
    _draw_stages(ax, run)
    if has_grad:
        ax.set_xlabel("")
        g = axes[1]
        g.plot(x, grad, color="tab:red", linewidth=0.8, alpha=0.8)
        g.set_ylabel("gradient norm")
        g.set_title(f"gradient norm (median {np.nanmedian(grad):.3g}, max {np.nanmax(grad):.3g})", fontsize=10)
        _format_axis(g, run)
        _draw_stages(g, run, label=False)
    return fig


def _plot_throughput(run: _Run) -> Any:
    fig = _figure(9, 4.5)
    ax = fig.add_subplot()
    x, tps = run.series("tokens_per_s")
    mfu = run.series("mfu")[1] * 100
    handles = []
    parts = []
    if np.isfinite(tps).any():
        handles += ax.plot(x, tps, color="tab:blue", linewidth=1.2, label="tokens/s")
        ax.yaxis.set_major_formatter(_count_formatter())
        ax.set_ylim(bottom=0, top=np.nanmax(tps) * 1.15)
        parts.append(f"median {format_count(float(np.nanmedian(tps)), 4)} tokens/s")
    ax.set_ylabel("tokens/s", color="tab:blue")
    _format_axis(ax, run)
    if np.isfinite(mfu).any():
        twin = ax.twinx()
        handles += twin.plot(x, mfu, color="tab:purple", linewidth=1.2, label="MFU")
        twin.set_ylabel("MFU (%)", color="tab:purple")
        twin.set_ylim(bottom=0, top=max(1.0, float(np.nanmax(mfu)) * 1.15))
        parts.append(f"MFU {np.nanmedian(mfu):.1f}%")
    if not handles:
        _no_data(ax, "no 'tokens_per_s' or 'mfu' in the train records")
    else:
        ax.legend(handles=handles, loc="lower right")
    _draw_stages(ax, run)
    ax.set_title(run.title("throughput") + ("\n" + ", ".join(parts) if parts else ""), fontsize=11)
    return fig


def _skip_layers(train: Sequence[dict[str, Any]], num_layers: int) -> list[bool]:
    """Per layer: is the last router class the skip class? Yes when ``skip_fraction`` is logged for the layer and
    matches that class's load in every record (a router without a skip class should log no ``skip_fraction``)."""
    skip = [False] * num_layers
    for layer in range(num_layers):
        seen = False
        consistent = True
        for record in train:
            loads, fractions = record.get("expert_load"), record.get("skip_fraction")
            if not isinstance(fractions, list) or layer >= len(fractions) or fractions[layer] is None:
                continue
            if not isinstance(loads, list) or layer >= len(loads) or not loads[layer]:
                continue
            seen = True
            last = loads[layer][-1]
            if last is None or abs(float(last) - float(fractions[layer])) > 1e-3:
                consistent = False
                break
        skip[layer] = seen and consistent
    return skip


def _has_loads(record: dict[str, Any]) -> bool:
    load = record.get("expert_load")
    return isinstance(load, list) and any(isinstance(row, list) and row for row in load)


def _expert_load_grid(run: _Run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loads [layers, classes, bins], bin edges in steps, steps of the records that have loads); NaN = no data.

    Records are averaged into at most ``_MAX_HEATMAP_COLUMNS`` equal-width step bins, so the image's x axis is
    linear in steps even when logging was irregular.
    """
    rows = [(r["step"], r["expert_load"]) for r in run.train if _has_loads(r)]
    num_layers = max(len(load) for _, load in rows)
    num_classes = max(len(layer) for _, load in rows for layer in load if isinstance(layer, list))
    data = np.full((len(rows), num_layers, num_classes), np.nan)
    for i, (_, load) in enumerate(rows):
        try:  # the usual case: a rectangular list of numbers
            block = np.asarray(load, dtype=float)
            if block.ndim != 2:
                raise ValueError
            data[i, :block.shape[0], :block.shape[1]] = block
        except (TypeError, ValueError):  # ragged rows or nulls
            for layer, values in enumerate(load):
                if isinstance(values, list):
                    data[i, layer, :len(values)] = [np.nan if v is None else v for v in values]
    steps = np.array([s for s, _ in rows], dtype=float)
    gap = float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0
    lo, hi = steps[0] - gap / 2, steps[-1] + gap / 2
    bins = int(min(_MAX_HEATMAP_COLUMNS, max(1, round((hi - lo) / max(gap, 1e-9)))))
    edges = np.linspace(lo, hi, bins + 1)
    which = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, bins - 1)
    total = np.zeros((bins, num_layers, num_classes))
    count = np.zeros((bins, num_layers, num_classes))
    valid = np.isfinite(data)
    filled, starts = np.unique(which, return_index=True)  # steps ascend, so each bin is one run of records
    total[filled] = np.add.reduceat(np.where(valid, data, 0.0), starts, axis=0)
    count[filled] = np.add.reduceat(valid.astype(float), starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return mean.transpose(1, 2, 0), edges, steps


def _plot_expert_load(run: _Run) -> Any:
    if not any(_has_loads(r) for r in run.train):
        fig = _figure(8, 3)
        ax = fig.add_subplot()
        ax.set_title(run.title("expert load"), fontsize=11)
        _no_data(ax, "no 'expert_load' in the train records")
        return fig
    from matplotlib.ticker import MaxNLocator

    loads, edges, _ = _expert_load_grid(run)
    num_layers, num_classes, _ = loads.shape
    skip = _skip_layers(run.train, num_layers)
    ncols = min(num_layers, max(1, math.ceil(math.sqrt(num_layers * 1.5))))
    nrows = math.ceil(num_layers / ncols)
    # Laid out by hand (inches): constrained layout takes seconds on a grid of dozens of panels.
    if num_layers == 1:
        panel_w, panel_h = 8.0, min(1.2 + 0.2 * num_classes, 5.0)
    else:
        panel_w, panel_h = (3.0 if num_layers <= 12 else 2.5), min(0.6 + 0.09 * num_classes, 3.0)
    left, right, top, bottom, gap_w, gap_h = 0.75, 1.15, 0.75, 0.55, 0.15, 0.3
    width = left + ncols * panel_w + (ncols - 1) * gap_w + right
    height = top + nrows * panel_h + (nrows - 1) * gap_h + bottom
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False, gridspec_kw=dict(
        left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height,
        wspace=gap_w / panel_w, hspace=gap_h / panel_h))

    # One colour scale for every panel, set by the real experts: the skip class can take far more tokens than any
    # expert and would otherwise wash the experts out; its row saturates instead and its value is in the titles.
    experts = [loads[layer, :num_classes - 1] if skip[layer] else loads[layer] for layer in range(num_layers)]
    expert_values = np.concatenate([_finite(e.ravel()) for e in experts])
    vmax = float(expert_values.max()) if expert_values.size and expert_values.max() > 0 else 1.0
    saturates = bool(np.nanmax(loads) > vmax * (1 + 1e-9))
    last_ratio = next((r.get("expert_load_max_over_mean") for r in reversed(run.train)
                       if isinstance(r.get("expert_load_max_over_mean"), list)), None)
    last_skip = next((r.get("skip_fraction") for r in reversed(run.train)
                      if isinstance(r.get("skip_fraction"), list)), None)

    step_of = run.step
    image = None
    for layer in range(num_layers):
        ax = axes[layer // ncols, layer % ncols]
        image = ax.imshow(loads[layer], aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=vmax,
                          extent=(edges[0], edges[-1], num_classes - 0.5, -0.5))
        parts = [f"layer {layer}"]
        if skip[layer] and last_skip is not None and layer < len(last_skip) and last_skip[layer] is not None:
            parts.append(f"skip {100 * last_skip[layer]:.0f}%")
        if last_ratio is not None and layer < len(last_ratio) and last_ratio[layer] is not None:
            parts.append(f"max/mean {last_ratio[layer]:.2f}")
        ax.set_title(" · ".join(parts), fontsize=8)
        _draw_stages(ax, run, x=step_of, label=layer < ncols, color="white")
        ax.tick_params(labelsize=7)
        if layer % ncols == 0:
            ax.set_ylabel("expert", fontsize=8)
        if layer // ncols == nrows - 1 or layer + ncols >= num_layers:
            ax.set_xlabel("step", fontsize=8)
            ax.xaxis.set_tick_params(labelbottom=True)
    for extra in range(num_layers, nrows * ncols):
        axes[extra // ncols, extra % ncols].set_visible(False)

    has_skip = any(skip)
    num_experts = num_classes - 1 if has_skip else num_classes
    if num_experts <= 8:
        ticks = list(range(num_experts))
    else:
        ticks = [int(t) for t in MaxNLocator(nbins=4, integer=True).tick_values(0, num_experts - 1)
                 if 0 <= t <= num_experts - 1]
    labels = [str(t) for t in ticks]
    if has_skip:
        ticks.append(num_classes - 1)
        labels.append("skip")
    axes[0, 0].set_yticks(ticks, labels)
    axes[0, 0].xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))

    bar_axes = fig.add_axes((1 - (right - 0.2) / width, bottom / height, 0.14 / width, 1 - (top + bottom) / height))
    bar = fig.colorbar(image, cax=bar_axes, extend="max" if saturates else "neither")
    bar.set_label("fraction of tokens" + (" (skip row may saturate)" if saturates else ""), fontsize=8)
    bar.ax.tick_params(labelsize=7)
    uniform = f", uniform = 1/{num_experts} = {1 / num_experts:.3f}" if num_experts else ""
    fig.suptitle(run.title("expert load per layer (router class x step)") + uniform, fontsize=11)
    return fig


# Per-layer routing figures of ``routing.png``: (record key, panel title, y-axis label, reference line or None).
_ROUTING_PANELS = (
    ("expert_load_max_over_mean", "busiest expert's load / mean", "max / mean", 1.0),
    ("expert_load_cv", "coefficient of variation of the loads", "std / mean", 0.0),
    ("expert_load_entropy", "entropy of the load over experts", "H / log E", 1.0),
    ("router_flip_rate", "flip rate (probe tokens whose top choice changed)", "share", 0.0),
    ("router_token_entropy", "router entropy per token (probe)", "H / log classes", None),
    ("skip_fraction", "skip share", "share", None),
)


def _layer_columns(records: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    """[records, layers] of a per-layer list field; NaN where a record lacks it or a layer's value is null."""
    width = max((len(r[key]) for r in records if isinstance(r.get(key), list)), default=0)
    out = np.full((len(records), width), np.nan)
    for i, record in enumerate(records):
        values = record.get(key)
        if isinstance(values, list):
            out[i, :len(values)] = [v if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan
                                    for v in values]
    return out


def _plot_routing(run: _Run) -> Any:
    """One panel per routing-health figure, one line per MoE layer, against the step."""
    fig = _figure(13, 6.5)
    axes = fig.subplots(2, 3, squeeze=False).ravel()
    steps = run.step
    for ax, (key, title, ylabel, reference) in zip(axes, _ROUTING_PANELS):
        ax.set_title(title, fontsize=9)
        values = _layer_columns(run.train, key)
        if not np.isfinite(values).any():
            _no_data(ax, f"no '{key}' in the train records")
            continue
        for layer in range(values.shape[1]):
            ax.plot(steps, values[:, layer], linewidth=0.9, label=f"layer {layer}")
        if reference is not None:
            ax.axhline(reference, color="0.3", linestyle=":", linewidth=1.0)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        _draw_stages(ax, run, x=steps, label=False)
    handles, labels = next(((a.get_legend_handles_labels()) for a in axes if a.get_legend_handles_labels()[0]),
                           ([], []))
    if handles:
        fig.legend(handles[:12], labels[:12], loc="outside right upper", fontsize=7)
    fig.suptitle(run.title("routing health per MoE layer"), fontsize=11)
    return fig
