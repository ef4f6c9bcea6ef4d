"""The run directory: what lives in it, and who may use it.

    <run_dir>/config.toml       the resolved config (every key): the run's identity
    <run_dir>/tokenizer.json    the data's tokenizer (generate/eval use it)
    <run_dir>/metrics.jsonl     one record per step and per evaluation
    <run_dir>/checkpoints/      training checkpoints (zaya.checkpoint.store)
    <run_dir>/plots/            written at the end of a run and by ``zaya plot``

A run directory belongs to one config: resuming with a config that differs in a key that changes what is computed
(any field not declared ``resumable`` in zaya.config) is refused, naming the keys.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from zaya.config import Config, config_differences, dump_config, load_config
from zaya.errors import ConfigError

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINTS = "checkpoints"


def prepare_run_dir(run_dir: Path, config: Config, resume: str, say: Callable[[str], None]) -> None:
    """Rank 0: refuse a run directory owned by a different config; with ``--resume never`` move an old run aside;
    write config.toml."""
    existing = run_dir / CONFIG_FILE
    if resume == "never" and run_dir.exists() and any(run_dir.iterdir()):
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
        run_dir.rename(aside)
        say(f"--resume never: moved the previous run in {run_dir} to {aside}")
    elif existing.is_file():
        try:
            old = load_config(existing)
        except ConfigError as err:
            raise ConfigError(f"{run_dir} holds a run whose {CONFIG_FILE} cannot be read ({err}); use "
                              "--resume never to move it aside, or another --run-dir") from None
        diff = config_differences(old, config)
        if diff:
            shown = ", ".join(diff[:6]) + (" ..." if len(diff) > 6 else "")
            raise ConfigError(f"{run_dir} belongs to a run with a different config ({shown} differ); resume it "
                              f"with its own config ({existing}), or pass --resume never (moves it aside) or "
                              "another --run-dir")
    elif run_dir.exists() and any(p.name not in (CHECKPOINTS,) for p in run_dir.iterdir()):
        raise ConfigError(f"{run_dir} exists and is not a zaya run directory (no {CONFIG_FILE}); choose another "
                          "--run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / CONFIG_FILE)
