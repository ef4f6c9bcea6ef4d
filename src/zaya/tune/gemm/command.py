"""``zaya tune gemm`` end to end: measure (or reload ``--from``), recommend, write the JSON, heatmaps and profile,
print the report.

Into the profile: ``peak_flops[dtype]`` (not from ``--quick``: its small square GEMM is no peak) and the ``gemm``
summary. The CPU Newton-Schulz blocks and the loss chunk are not measured here; their defaults stay.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from zaya.core.errors import ConfigError
from zaya.tune import report as skeleton
from zaya.tune.gemm.options import Options, add_arguments, options_from_args
from zaya.tune.gemm.recommend import recommend
from zaya.tune.gemm.sweep import sweep
from zaya.tune.gemm.text import report, what

__all__ = ["add_arguments", "run"]


def _load_config(path: str | None, device_type: str) -> tuple[Any, str]:
    """(Config, where it came from): the named file, or the device's default preset, or the dataclass defaults."""
    from zaya.config import Config, load_config

    if path:
        return load_config(path), path
    preset = Path("configs/tiny.toml" if device_type == "cpu" else "configs/zaya1-base.toml")
    if preset.is_file():
        return load_config(preset), str(preset)
    return Config(), "ZAYA1-base defaults (zaya.config.ModelConfig)"


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The profile's ``gemm`` field: the setup, peaks and each dtype's recommendation (not every measurement)."""
    recs = {}
    for dtype, rec in result["recommendation"].items():
        b = rec["best"]
        recs[dtype] = None if b is None else {
            **{k: b[k] for k in ("hidden_size", "expert_hidden_size", "num_query_heads", "num_kv_heads", "head_dim",
                                 "micro_batch_tokens", "tflops", "tokens_per_s", "vs_config")},
            "budget": rec["budget"], "budget_of": rec["budget_of"],
            "config_tokens_per_s": rec["config"]["tokens_per_s"]}
    return {"config": result["config"], "dtypes": result["dtypes"], "tokens": result["tokens"],
            "widths": result["widths"], "passes": result["passes"], "quick": result["quick"],
            "peak": {d: {"flops": p["flops"], "shape": p["shape"], "kind": p["kind"]}
                     for d, p in result["peak"].items()},
            "recommendation": recs, "results": result.get("json"), "measured_at": result["measured_at"],
            "torch": result["torch"], "command": result["command"]}


def _analyse(result: dict[str, Any], cfg: Any, train: Any, opts: Options) -> None:
    from zaya.model.info import forward_flops_per_token

    flops = forward_flops_per_token(cfg, context=max(1, train.seq_len // 2))
    result["untimed_share"] = (flops["attention_scores"] + flops["cca_convolutions"]) / sum(flops.values())
    micro = train.micro_batch_size * train.seq_len
    result["recommendation"] = {d: recommend(result, cfg, opts.budget, opts.budget_of, opts.tolerance, micro,
                                             train.seq_len, d) for d in result["dtypes"]}


def _load() -> float | None:
    """The 1-minute load average (None where the OS has none): other work on the cores slows a CPU sweep."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _from_saved(path: str) -> tuple[dict[str, Any], Any, Any]:
    from zaya.config import TrainConfig, model_config_from_dict
    from zaya.core.fsutil import read_json

    p = Path(path)
    try:
        result = read_json(p)
        cfg = model_config_from_dict(result["model"], str(p))
        train = replace(TrainConfig(), micro_batch_size=result["micro_batch_size"], seq_len=result["seq_len"])
        missing = [k for k in ("measurements", "tokens", "widths", "passes", "dtypes", "peak") if k not in result]
        if missing:
            raise KeyError(", ".join(missing))
    except FileNotFoundError:
        raise ConfigError(f"--from {p}: no such file (a sweep's gemm-<device>.json, written to --out)") from None
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError) as err:  # not JSON (nested past the parser's depth too), or not a result
        raise ConfigError(f"--from {p}: not a `zaya tune gemm` result ({err.__class__.__name__}: {err})") from None
    return result, cfg, train


def _measure(opts: Options) -> tuple[dict[str, Any], Any, Any, Any]:
    """(result, model config, train config, device) of a fresh sweep."""
    import torch

    from zaya.config import to_dict
    from zaya.core.device import resolve_device
    from zaya.core.hardware import device_key, device_name

    device = resolve_device(opts.device)
    config, source = _load_config(opts.config, device.type)
    cfg, train = config.model, config.train
    result = {"command": skeleton.command_line("zaya tune gemm"), "measured_at": skeleton.now(),
              "torch": torch.__version__, "device": str(device), "device_key": device_key(device),
              "device_name": device_name(device), "threads": torch.get_num_threads(),
              "float32_matmul_precision": torch.get_float32_matmul_precision(), "config": source,
              "model": to_dict(cfg), "micro_batch_size": train.micro_batch_size, "seq_len": train.seq_len,
              "dtypes": list(opts.dtypes), "quick": opts.quick}
    result["load_before"] = _load()
    result.update(sweep(cfg, device, opts, skeleton.progress()))
    result["load_after"] = _load()
    return result, cfg, train, device


def _write(result: dict[str, Any], opts: Options, device: Any) -> None:
    """The heatmaps, the profile (``peak_flops`` and the summary) and the result's JSON, each named in the result."""
    from zaya.core.device import short_name
    from zaya.tune.gemm.heatmap import plot

    out = Path(opts.out)
    stem = f"gemm-{result['device_key']}"
    result["json"] = str(out / f"{stem}.json")
    files = []
    if opts.plot:
        for dtype in result["dtypes"]:
            path = out / f"{stem}-{short_name(dtype)}.png"
            plot(result, dtype, path, f"zaya tune gemm: {result['device_name']}, {dtype}, {result['config']}: "
                                      f"achieved throughput ({what(result)})")
            files.append(str(path))
    if opts.save:
        from zaya.core.hardware import load_profile

        peaks = dict(load_profile(device, refresh=True).peak_flops)
        if not opts.quick:  # a smoke test's small square GEMM is no peak to measure MFU against
            peaks.update({d: p["flops"] for d, p in result["peak"].items() if p.get("flops")})
        result["profile"] = skeleton.save_to_profile(device, peak_flops=peaks, gemm=summary(result))
    result["files"] = [result["json"], *files]
    skeleton.write_json(result["json"], result)


def run(args: argparse.Namespace) -> int:
    """``zaya tune gemm``: measure (or reload), recommend, write the JSON, heatmaps and profile, print the report."""
    opts = options_from_args(args)
    if opts.from_json:
        result, cfg, train = _from_saved(opts.from_json)
        result["files"] = []  # this run writes nothing
        result.pop("profile", None)
        _analyse(result, cfg, train, opts)
    else:
        result, cfg, train, device = _measure(opts)
        _analyse(result, cfg, train, opts)
        _write(result, opts, device)
    return skeleton.emit(result, opts.json, report)
