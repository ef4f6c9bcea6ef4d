"""The run directory's names, spelled once: every package that writes or reads a run finds its files here.

    <run_dir>/config.toml       the resolved config (every key): the run's identity
    <run_dir>/tokenizer.json    the data's tokenizer (generate/eval use it)
    <run_dir>/metrics.jsonl     one record per step and per evaluation (zaya.core.metrics_file)
    <run_dir>/checkpoints/      training checkpoints, one step-NNNNNNNN/ each (zaya.checkpoint.store)
    <run_dir>/plots/            written at the end of a run and by ``zaya plot``
    <run_dir>/tensorboard/      TensorBoard scalars (train.tensorboard = true)
    <run_dir>/aegis/            the supervisor's heartbeats, directives and events (zaya.aegis.env.aegis_dir)
"""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "config.toml"
TOKENIZER_FILE = "tokenizer.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
PLOTS = "plots"
TENSORBOARD = "tensorboard"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def plots_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / PLOTS
