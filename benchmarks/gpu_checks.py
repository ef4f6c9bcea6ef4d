"""The Python side of the GPU suite: one check per call, one JSON line on stdout (progress on stderr).

    python benchmarks/gpu_checks.py CHECK [--device cuda|cuda:N|cpu] [--quick] [--budget S] [--micro-batch N]
    python benchmarks/gpu_checks.py --list

``benchmarks/gpu_suite.sh`` runs every check this way, each in its own process with its own timeout; docs/gpu.md
describes the checks and every key of their JSON lines. ``--device cpu`` is the smoke mode: every check runs its
code path at tiny sizes on the CPU (what needs a GPU, such as the sync debug mode, is reported as skipped), so the
suite can be tested on a machine without one. ``--quick`` shrinks every check on a GPU (a first smoke run).

The checks live here (the ones that launch ``zaya train``, torchrun and the other benchmark scripts, and the
in-process host-sync count), in ``gpu_model_step.py`` (the full model's training step, eager and compiled),
``gpu_decode.py`` (the serving engine's decode) and ``gpu_kernels.py`` (flash attention, grouped_mm against the
loop, Muon's Newton-Schulz methods, the Triton kernels); ``gpu_predict.py`` sets the cost model's prediction
beside the step, MoE-block and Muon figures.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from gpu_common import (ROOT, CheckTimeout, Ctx, clean, cpu_bf16_gflops, error_text, install_sigterm, json_lines,
                        median, read_jsonl, rnd, run_command, say, tail)
from gpu_predict import add_moe_block_prediction

CHECKS = ("train_small", "parallel_modes", "host_syncs", "flash_attention", "grouped_mm_vs_loop", "moe_block",
          "model_step", "model_step_deep", "muon", "fused_norm", "ns_triton", "decode", "expert_parallel")

# Leave this much of a check's budget for reading results and printing the JSON line after a subprocess.
MARGIN_S = 15.0


# ------------------------------------------------------------------------------------------------ zaya train runs
_CKPT_LINE = re.compile(r"checkpoint (\S+) \(([\d,]+) MB, ([\d.]+) s, (?:async: training waited ([\d.]+) s|blocking)\)")
_RESUMED = re.compile(r"resumed from (\S+)( \(RAM tier\))? \(step (\d+)")

# small.toml shrunk to a CPU-sized model for the smoke mode (the same code path, the same data).
_SMOKE_MODEL = ["model.hidden_size=128", "model.num_layers=2", "model.num_query_heads=4", "model.num_kv_heads=2",
                "model.head_dim=32", "model.num_experts=4", "model.expert_hidden_size=128",
                "model.router_hidden_size=32"]
# The smoke mode names the peak for MFU and runs Muon's Newton-Schulz in fp32: a CPU without native bf16 takes most
# of a minute to measure the bf16 peak, and bf16 matmuls dominate the step there.
_SMOKE_TRAIN = ["train.peak_flops=1e11", 'optim.muon_ns_dtype="float32"']


def _sets(values: list[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        out += ["--set", v]
    return out


def _train_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of one run's train records: the first step of a run (compilation, allocation) is left out of the
    medians."""
    steps = [r for r in records if not r.get("skipped")]
    timed = steps[1:] if len(steps) > 1 else steps
    tok = [r["tokens_per_s"] for r in timed if isinstance(r.get("tokens_per_s"), (int, float))]
    mfu = [r["mfu"] for r in timed if isinstance(r.get("mfu"), (int, float))]
    loads = [max(r["expert_load_max_over_mean"]) for r in timed if r.get("expert_load_max_over_mean")]
    return {"first_step": records[0]["step"] if records else None,
            "last_step": records[-1]["step"] if records else None,
            "tokens_per_s": rnd(median(tok)), "tokens_per_s_max": rnd(max(tok)) if tok else None,
            "mfu": rnd(median(mfu)), "step_time_s": rnd(median([r["step_time_s"] for r in timed
                                                                if "step_time_s" in r])),
            "first_loss": rnd(steps[0]["loss"]) if steps else None,
            "final_loss": rnd(steps[-1]["loss"]) if steps else None,
            "max_expert_load_over_mean": rnd(median(loads))}


def check_train_small(ctx: Ctx, r: dict[str, Any]) -> None:
    """configs/small.toml for a few dozen steps with async checkpoints, then resumed to more steps."""
    steps1 = ctx.pick(16, 6, 4)
    every = ctx.pick(8, 3, 2)
    steps2 = steps1 + ctx.pick(8, 3, 2)
    run_dir = ctx.tmp / "small"
    sets = [f'train.dtype="{ctx.train_dtype}"', f"checkpoint.every={every}", "checkpoint.async_save=true",
            "checkpoint.keep=1",
            f"train.eval_every={every}", "train.log_every=1", "data.val_batches=2", "train.sample_tokens=32"]
    if ctx.level == "quick":
        sets.append("model.num_layers=4")
    if ctx.level == "smoke":
        sets += _SMOKE_MODEL + _SMOKE_TRAIN + ["train.micro_batch_size=2", "train.seq_len=64", "data.val_batches=1",
                                               "train.sample_tokens=4"]
    r.update(config="configs/small.toml", overrides=sets, max_steps=[steps1, steps2], run_dir=str(run_dir))
    metrics = run_dir / "metrics.jsonl"
    outputs = []
    for i, max_steps in enumerate((steps1, steps2), start=1):
        cmd = [sys.executable, "-m", "zaya", "train", "--config", "configs/small.toml", "--device", ctx.device_arg,
               "--run-dir", str(run_dir), "--max-steps", str(max_steps), *_sets(sets)]
        before = len([x for x in read_jsonl(metrics) if x.get("kind") == "train"])
        budget = ctx.remaining() - MARGIN_S
        if budget < 20:
            raise CheckTimeout(f"no time left for run {i} ({ctx.remaining():.0f} s of the budget)")
        res = run_command(cmd, budget if i == 2 else budget * 0.65, prefix=f"[train_small {i}] ")
        text = res["stdout"] + res["stderr"]
        outputs.append(text)
        recs = [x for x in read_jsonl(metrics) if x.get("kind") == "train"][before:]
        r[f"run{i}"] = {"rc": res["rc"], "seconds": rnd(res["seconds"]), **_train_stats(recs)}
        if res["rc"] != 0:
            r[f"run{i}"]["output_tail"] = tail(text)
            raise RuntimeError(f"run {i} (--max-steps {max_steps}) exited with {res['rc']}")
    train = [x for x in read_jsonl(metrics) if x.get("kind") == "train"]
    val = [x for x in read_jsonl(metrics) if x.get("kind") == "val"]
    steps = [x["step"] for x in train]
    resumed = _RESUMED.search(outputs[1])
    r["resumed_from"] = ({"path": resumed.group(1), "step": int(resumed.group(3)), "ram_tier": bool(resumed.group(2))}
                         if resumed else None)
    # The metrics decide (a run that started over would repeat steps 1..); the log line is checked when present.
    r["metrics_continue"] = steps == list(range(1, steps2 + 1))
    r["resume_message_seen"] = bool(resumed)
    r["resume_ok"] = r["metrics_continue"] and (resumed is None or int(resumed.group(3)) == steps1)
    saves = []
    for run, text in enumerate(outputs, start=1):
        for m in _CKPT_LINE.finditer(text):
            saves.append({"run": run, "checkpoint": Path(m.group(1)).name, "mb": int(m.group(2).replace(",", "")),
                          "seconds": float(m.group(3)),
                          "async_blocked_s": float(m.group(4)) if m.group(4) is not None else None})
    r["checkpoint_saves"] = saves
    r["exit_codes"] = [r["run1"]["rc"], r["run2"]["rc"]]
    r["tokens_per_s"] = r["run1"]["tokens_per_s"]
    r["mfu"] = r["run1"]["mfu"]
    r["val_loss"] = rnd(val[-1]["val_loss"]) if val else None
    r["ok"] = r["exit_codes"] == [0, 0] and r["resume_ok"]
    if not r["ok"]:
        r["error"] = (f"resume not confirmed: resumed_from {r['resumed_from']}, metrics steps {steps[:3]}..."
                      f"{steps[-3:]} (expected 1..{steps2}, the resume from step {steps1})")


def check_parallel_modes(ctx: Ctx, r: dict[str, Any]) -> None:
    """ddp, zero1 and fsdp for a few steps of configs/tiny.toml under torchrun (NCCL on GPUs, gloo on the CPU)."""
    torch = ctx.torch
    world = min(torch.cuda.device_count(), 2) if ctx.cuda else 2
    steps = ctx.pick(8, 4, 3)
    r.update(world_size=world, distributed=world > 1, backend=("nccl" if ctx.cuda else "gloo") if world > 1 else None,
             config="configs/tiny.toml", steps=steps)
    if world == 1:
        r["note"] = "one GPU: torchrun starts one rank and zaya runs it without a process group (no NCCL)"
    sets = [f'train.dtype="{ctx.train_dtype}"', "train.eval_every=0", "checkpoint.every=0", "train.log_every=1",
            'train.sample_prompt=""', "data.val_batches=1"]
    if ctx.level == "smoke":
        sets += _SMOKE_MODEL + _SMOKE_TRAIN + ["train.micro_batch_size=4", "train.seq_len=64"]
    modes: dict[str, Any] = {}
    r["modes"] = modes
    names = ("ddp", "zero1", "fsdp")
    for i, mode in enumerate(names):
        run_dir = ctx.tmp / f"parallel-{mode}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "-m", "zaya", "train", "--config", "configs/tiny.toml", "--device", ctx.ranks_device_arg,
               "--run-dir", str(run_dir), "--max-steps", str(steps), "--resume", "never",
               *_sets([f'train.parallel="{mode}"'] + sets)]
        budget = (ctx.remaining() - MARGIN_S) / (len(names) - i)
        if budget < 15:
            modes[mode] = {"skipped": f"no time left ({ctx.remaining():.0f} s of the budget)"}
            continue
        res = run_command(cmd, budget, env={"OMP_NUM_THREADS": "1"}, prefix=f"[{mode}] ")
        recs = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x.get("kind") == "train"]
        stats = _train_stats(recs)
        modes[mode] = {"rc": res["rc"], "final_loss": stats["final_loss"], "tokens_per_s": stats["tokens_per_s"],
                       "mfu": stats["mfu"], "steps_done": len(recs), "seconds": rnd(res["seconds"])}
        if res["rc"] != 0:
            modes[mode]["output_tail"] = tail(res["stdout"] + res["stderr"])
    done = [m for m in modes.values() if "rc" in m]
    losses = [m["final_loss"] for m in done if isinstance(m.get("final_loss"), float)]
    if len(losses) > 1:
        r["final_loss_spread"] = rnd((max(losses) - min(losses)) / max(abs(min(losses)), 1e-12))
    failed = [name for name, m in modes.items() if m.get("rc") != 0]
    r["ok"] = not failed
    if failed:
        r["error"] = "failed or not run: " + ", ".join(f"{n} (rc {modes[n].get('rc', 'none')})" for n in failed)


# ------------------------------------------------------------------------------------------------ host syncs
_SYNC_MESSAGE = "synchronizing CUDA operation"


def check_host_syncs(ctx: Ctx, r: dict[str, Any]) -> None:
    """The trainer's step on the device: synchronisations of one step (after a warm-up step) with the CUDA sync
    debug mode; on the CPU the same step under zaya.distributed.checks.HostReads."""
    torch = ctx.torch
    from zaya.config import load_config
    from zaya.distributed.runtime import start, stop
    from zaya.train.step import HOST_READS_PER_STEP
    from zaya.train.trainer import Trainer

    mb, seq = ctx.pick((16, 128), (16, 128), (4, 32))
    run_dir = ctx.tmp / "host-syncs"
    overrides = [f"train.run_dir={_toml_str(run_dir)}", f"train.device={_toml_str(ctx.device_arg)}",
                 f"train.micro_batch_size={mb}", f"train.seq_len={seq}", f"train.global_batch_tokens={2 * mb * seq}",
                 f'train.dtype="{ctx.train_dtype}"', "train.eval_every=0", "checkpoint.every=0",
                 'train.sample_prompt=""'] + (_SMOKE_MODEL + _SMOKE_TRAIN if ctx.level == "smoke" else [])
    r.update(config="configs/tiny.toml", overrides=overrides, budget=HOST_READS_PER_STEP)
    config = load_config(ROOT / "configs" / "tiny.toml", overrides)
    rt = start(config.train.timeout_s, config.train.startup_timeout_s, config.train.device)
    trainer = None
    try:
        trainer = Trainer.build(config, rt, resume="never")
        t0 = time.perf_counter()
        first = trainer.step()
        ctx.sync()
        r["warmup_step_s"] = rnd(time.perf_counter() - t0)
        r["accumulation"] = first.get("accumulation") if first else None
        if ctx.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    t0 = time.perf_counter()
                    record = trainer.step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                ctx.sync()
                r["step_s"] = rnd(time.perf_counter() - t0)
            syncs = [w for w in caught if _SYNC_MESSAGE in str(w.message)]
            places = Counter(f"{_short_path(w.filename)}:{w.lineno}" for w in syncs)
            r["syncs_per_step"] = len(syncs)
            r["sync_locations"] = [{"where": k, "count": n} for k, n in places.most_common(12)]
            if len(syncs) > HOST_READS_PER_STEP:
                r["first_warnings"] = [f"{_short_path(w.filename)}:{w.lineno}: {str(w.message)[:200]}"
                                       for w in syncs[:5]]
            r["ok"] = record is not None and len(syncs) <= HOST_READS_PER_STEP
            if not r["ok"]:
                r["error"] = (f"{len(syncs)} synchronising calls in one step, budget {HOST_READS_PER_STEP}: "
                              + "; ".join(f"{x['count']} x {x['where']}" for x in r["sync_locations"][:6]))
        else:
            from zaya.distributed.checks import HostReads

            with HostReads() as reads:
                record = trainer.step()
            r["skipped"] = ("torch.cuda.set_sync_debug_mode needs a CUDA device; the step ran and its host reads "
                            "were counted with zaya.distributed.checks.HostReads instead")
            r["cpu_host_reads"] = reads.total
            r["cpu_host_reads_report"] = reads.report()[:1500]
            r["step_ran"] = record is not None
    finally:
        if trainer is not None:
            trainer.close()
        stop(rt)


def _toml_str(value: Any) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _short_path(filename: str) -> str:
    for root in (str(ROOT) + os.sep, os.sep + "site-packages" + os.sep):
        if root in filename:
            return filename.split(root, 1)[1]
    return filename


# ------------------------------------------------------------------------------------------------ moe_block script
def check_moe_block(ctx: Ctx, r: dict[str, Any]) -> None:
    """benchmarks/moe_block.py --device DEVICE --shapes base (tiny shape on the CPU), its JSON passed through."""
    script = ROOT / "benchmarks" / "moe_block.py"
    source = script.read_text()
    has_device = '"--device"' in source
    args = ["--shapes", ctx.pick("base", "base", "tiny")]
    if ctx.level != "full":
        args += ["--repeats", "2"]
    if ctx.level == "smoke":
        args += ["--tokens", "256"]
    if has_device:
        args = ["--device", ctx.device_arg] + args
    elif ctx.cuda:
        r["skipped"] = "benchmarks/moe_block.py has no --device flag yet (it would run on the CPU)"
        return
    if not ctx.cuda:
        gflops = cpu_bf16_gflops(ctx)
        r["cpu_bf16_gflops"] = rnd(gflops)
        # The script times a 4096^3 bf16 matmul (137 GFLOP) 6+ times as its peak yardstick.
        if gflops < 20:
            r["skipped"] = (f"this CPU multiplies bf16 at {gflops:.1f} GFLOP/s (no native bf16): the script's "
                            f"4096^3 bf16 peak matmuls alone would take {6 * 137 / gflops / 60:.0f} minutes")
            return
    r["command"] = "benchmarks/moe_block.py " + " ".join(args)
    res = run_command([sys.executable, str(script), *args], ctx.remaining() - MARGIN_S, prefix="[moe_block] ")
    results = json_lines(res["stdout"])
    r["rc"] = res["rc"]
    r["results"] = results
    r["notes"] = [line.strip() for line in res["stdout"].splitlines() if line.startswith("#")][:12]
    for key in ("speedup", "ours_ms", "fraction_of_peak", "speedup_vs_hf_gmm", "max_expert_load"):
        if results and key in results[-1]:
            r[key] = results[-1][key]
    if results and "ours_ms" in results[-1]:
        add_moe_block_prediction(ctx, r, results[-1].get("shape", args[args.index("--shapes") + 1]),
                                 results[-1].get("tokens", 4096), results[-1]["ours_ms"])
    r["ok"] = res["rc"] == 0 and bool(results)
    if not r["ok"]:
        r["error"] = f"exit code {res['rc']}: {tail(res['stderr'] or res['stdout'], 800)}"
    if ctx.cuda:
        _moe_block_kernels(ctx, r)


def _moe_block_kernels(ctx: Ctx, r: dict[str, Any]) -> None:
    """The cost model's open question on the MoE block (benchmarks/results.md, "Cost model"): the host's issue time
    beside the whole time, each kernel's device time and the grouped GEMMs alone
    (``benchmarks/cost_model.py --moe-device``), kept under ``kernels``."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cost_model.py"), "--moe-device", ctx.device_arg,
           "--rounds", str(ctx.pick(5, 3, 2))]
    res = run_command(cmd, ctx.remaining() - MARGIN_S, prefix="[moe_block kernels] ")
    lines = [line for line in json_lines(res["stdout"]) if "moe_block_device" in line]
    if res["rc"] == 0 and lines:
        r["kernels"] = lines[-1]["moe_block_device"]
    else:
        r["kernels_error"] = f"exit code {res['rc']}: {tail(res['stderr'] or res['stdout'], 600)}"


# ------------------------------------------------------------------------------------------------ dispatch
def _load(name: str) -> Callable[[Ctx, dict[str, Any]], None]:
    if name in ("model_step", "model_step_deep"):
        import gpu_model_step

        return getattr(gpu_model_step, f"check_{name}")
    if name == "decode":
        from gpu_decode import check_decode

        return check_decode
    if name == "expert_parallel":
        from gpu_expert_parallel import check_expert_parallel

        return check_expert_parallel
    if name == "muon":
        import gpu_kernels
        from gpu_predict import add_muon_prediction

        def check_muon(ctx: Ctx, r: dict[str, Any]) -> None:
            gpu_kernels.check_muon(ctx, r)
            add_muon_prediction(ctx, r)

        return check_muon
    if name in ("flash_attention", "grouped_mm_vs_loop", "fused_norm", "ns_triton"):
        import gpu_kernels

        return getattr(gpu_kernels, f"check_{name}")
    return globals()[f"check_{name}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("check", nargs="?", choices=CHECKS)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (the smoke mode)")
    p.add_argument("--quick", action="store_true", help="shrink the check (a first smoke run on a GPU)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds this check may take (the suite's timeout)")
    p.add_argument("--micro-batch", type=int, default=0, help="model_step: micro-batch to try first (default 4)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (run dirs, checkpoints)")
    p.add_argument("--list", action="store_true", help="print the check names and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CHECKS))
        return 0
    if args.check is None:
        p.error("name a check (or --list)")

    # stdout carries only the JSON line: everything else (zaya's own prints, library output, C-level writes to fd 1)
    # goes to stderr.
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    install_sigterm()
    started = time.perf_counter()
    level = "smoke" if args.device == "cpu" else ("quick" if args.quick else "full")
    r: dict[str, Any] = {"check": args.check}
    tmp = Path(tempfile.mkdtemp(prefix=f"zaya-gpu-{args.check}-", dir=os.environ.get("ZAYA_GPU_TMP") or None))
    try:
        ctx = Ctx(args.device, level, args.budget, tmp, args.micro_batch)
        if ctx.cuda and not ctx.torch.cuda.is_available():
            r.update(device=str(ctx.device), level=level, skipped="no GPU visible to torch")
        else:
            r.update(device=ctx.describe_device(), level=level)
            say(f"== {args.check} on {r['device']} ({level}; budget {args.budget:.0f} s; scratch {tmp})")
            _load(args.check)(ctx, r)
    except BaseException as exc:  # noqa: BLE001 - one JSON line whatever happens (a timeout, an OOM, a bug)
        if isinstance(exc, KeyboardInterrupt):
            r["error"] = "interrupted"
        else:
            r["error"] = error_text(exc)
            if not isinstance(exc, CheckTimeout):
                r["traceback"] = tail("".join(traceback.format_exception(exc)), 2500)
        r["ok"] = False
        say(f"{args.check}: {r['error']}")
        if "traceback" in r:
            say(r["traceback"])
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if "skipped" not in r or "ok" in r:
        r.setdefault("ok", False)
        r.setdefault("error", None)
    kernels = sys.modules.get("zaya.core.kernels")
    if kernels is not None and kernels.failed:  # a Triton kernel fell back to torch here: its timings are torch's
        r["kernels_switched_off"] = dict(kernels.failed)
    r["seconds"] = rnd(time.perf_counter() - started)
    import json

    real_stdout.write(json.dumps(clean(r)) + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
