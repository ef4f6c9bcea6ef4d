"""Router ablation: the tiny model on the built-in corpus, same tokens, seed and schedule, with four routers.

* ``zaya-adaptive``: the ZAYA1 router (down-projection, EDA, MLP, skip class) with zaya's adaptive bias balancing;
* ``zaya-adamw``: the ZAYA1 router with the published ports' AdamW-style balancing (lr 1e-3);
* ``linear-bias``: a linear top-1 router with the adaptive bias balancing;
* ``linear-aux``: a linear top-1 router with a Switch-style auxiliary load-balancing loss (coefficient 0.01) and
  no bias balancing.

Each variant is one ``zaya train`` run in this process (``zaya.train.trainer.train``), so they see the same data
order, initial weights of every shared part and the same LR schedule. Reported per variant (one JSON line each,
then a summary line): the final validation loss; over the last third of the steps, per step the worst layer's
max/mean expert load (its mean and maximum over those steps), the mean coefficient of variation of the loads, the
mean router flip rate (the routing probe), the mean skip share; the median tokens/s of the steps after the
first; the parameter count.

    python benchmarks/router_ablation.py                 # 150 steps x 1,024 tokens per variant
    python benchmarks/router_ablation.py --quick         # a smoke run (tests): 6 steps x 256 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from zaya.core.layout import metrics_path
from zaya.core.metrics_file import read_metrics

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

VARIANTS = {
    "zaya-adaptive": ['model.router="zaya"', 'model.router_balancing="adaptive"'],
    "zaya-adamw": ['model.router="zaya"', 'model.router_balancing="adamw"', "model.router_balance_lr=1e-3"],
    "linear-bias": ['model.router="linear"', 'model.router_balancing="adaptive"'],
    "linear-aux": ['model.router="linear"', 'model.router_balancing="none"', "model.router_aux_loss_coef=0.01"],
}


def last_third_stats(records: list[dict]) -> dict:
    """Load statistics over the last third of the train records (per step: the worst layer)."""
    tail = records[len(records) - max(1, len(records) // 3):]

    def worst(key: str) -> list[float]:
        return [max(v for v in r[key] if v is not None) for r in tail if r.get(key)]

    def mean_over_layers(key: str) -> list[float]:
        values = [[v for v in r[key] if v is not None] for r in tail if r.get(key)]
        return [sum(v) / len(v) for v in values if v]

    load, cv, flips, skip = worst("expert_load_max_over_mean"), mean_over_layers("expert_load_cv"), \
        mean_over_layers("router_flip_rate"), mean_over_layers("skip_fraction")
    mean = lambda xs: round(statistics.fmean(xs), 4) if xs else None  # noqa: E731
    return {"steps_in_last_third": len(tail), "load_max_over_mean_mean": mean(load),
            "load_max_over_mean_max": round(max(load), 4) if load else None, "load_cv_mean": mean(cv),
            "flip_rate_mean": mean(flips), "skip_share_mean": mean(skip)}


def run_variant(name: str, settings: list[str], args: argparse.Namespace, work: Path) -> dict:
    from zaya.config import load_config
    from zaya.train.trainer import train

    run_dir = work / name
    overrides = [f"train.max_steps={args.steps}", f"train.micro_batch_size={args.micro_batch_size}",
                 f'train.dtype="{args.dtype}"', f'optim.muon_ns_dtype="{args.dtype}"', "train.eval_every=0",
                 "checkpoint.every=0", "train.sample_tokens=0", f"train.log_every={max(1, args.steps // 5)}",
                 f'train.run_dir="{run_dir}"', "train.peak_flops=1e12", *settings]
    config = load_config(args.config, overrides)
    started = time.perf_counter()
    summary = train(config, resume="never")
    wall = time.perf_counter() - started
    steps = [r for r in read_metrics(metrics_path(run_dir), ["train"])["train"] if not r.get("skipped")]
    from zaya.model import ZayaForCausalLM

    params = sum(p.numel() for p in ZayaForCausalLM(config.model).parameters())
    return {"variant": name, "settings": settings, "tokens_per_step": args.micro_batch_size * config.train.seq_len,
            "val_loss": round(summary["val_loss"], 4),
            "final_train_loss": round(summary["final_loss"], 4), **last_third_stats(steps),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steps[1:] or steps)),
            "parameters": params, "wall_s": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/tiny.toml",
                        help="the base config (default: the tiny model on the built-in corpus)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per variant")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per step (tiny: 128 tokens each)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="train.dtype (bfloat16 only where the CPU has native bf16)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 steps of 2 sequences")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.micro_batch_size = 6, 2
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="zaya-router-ablation-") as tmp:
        work = args.out or Path(tmp)
        results = []
        for name in names:
            results.append(run_variant(name, VARIANTS[name], args, work))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"summary": True, "steps": args.steps, "tokens_per_step": results[0]["tokens_per_step"],
                      "dtype": args.dtype, "val_loss": {r["variant"]: r["val_loss"] for r in results},
                      "load_max_over_mean_mean": {r["variant"]: r["load_max_over_mean_mean"] for r in results}}))


if __name__ == "__main__":
    main()
