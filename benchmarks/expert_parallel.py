"""Expert parallelism on gloo ranks: per-step losses against the same ranks without it, expert bytes per rank, and
step time with the all-to-all's share.

Each case trains ``configs/tiny.toml`` (8 experts, top-1, 4 layers, d=256; the built-in Shakespeare corpus, prepared
once into zaya's cache) for ``--steps`` steps in fp32 on CPU ranks started by torchrun (``python -m
torch.distributed.run --standalone``; gloo, one thread per rank), micro-batches of ``--micro-batch`` x
``--seq-len`` tokens per rank, ``train.parallel`` and ``train.expert_parallel`` as the case says; no sample,
evaluation, routing probe or checkpoint but the final one. A case runs twice, at ep = 1 and at its degree, and
reports:

* ``max_rel_loss_diff``: the largest |loss_ep - loss_1| / loss_1 over the steps (metrics.jsonl);
* ``expert_weight_bytes`` / ``expert_state_bytes``: per rank at the end (the expert tensors' own bytes, and those of
  their optimizer state), at ep = 1 and at the degree (``ratio`` = the first over the second);
* ``skip_share``: the share of routed assignments that took the skip class, over the ep run's steps and layers;
* ``step_s``: the median step time after the first two steps (metrics.jsonl's step_time_s), profiled steps left out,
  at both degrees;
* ``exchange_share``: with ``--profile``, the share of steps 5-8's wall time (rank 0, torch.profiler over CPU ops)
  spent in the all-to-all operators (every operator whose name holds ``all_to_all``, ``alltoall`` or
  ``wait_tensor``, self time: the exchanges' launch and the waits for them).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/expert_parallel.py [--cases 2:2:zero1:zaya,...] [--profile]``;
one JSON line per case. Cases are ``world:ep:parallel:router`` (router ``zaya``, ``zaya+skip`` (skip bias 0, so
tokens take it), or ``linear``).

**Step time against ZeRO-1** (``--rounds R``, with ``--world``, ``--ep`` and ``--model-set`` for the shape): ZeRO-1
without expert parallelism and ZeRO-1 at ``--ep`` on the same ranks, micro-batch and so global batch, alternated for
R rounds (who goes first alternates too: the machine is shared, so each round's ratio compares neighbours in time);
each run's step time is the median of its timed steps (after two of warm-up); the ep run then profiles its last
four steps as above (``exchange_ms``: the all-to-all operators' time per step on rank 0). One ``zaya tune comm``
sweep of all-to-all over the same ranks (in the middle of the rounds) gives the prediction for the same exchanges:
``zaya.tune.comm.expert_all_to_all``'s four exchanges per MoE layer of one micro-batch's routed rows, priced from the
measured curve at that message size (``price_all_to_all``), as ``zaya tune comm --config`` and ``zaya plan`` do; the
layers' counts exchanges (a few bytes each) are apart (``counts_ms_predicted``: one 4 KiB all-to-all's time per
layer). One JSON line: per round the two step times and their
ratio (ZeRO-1 / ep: above 1 means expert parallelism is faster), the median ratio and its range, and measured
against predicted all-to-all time per step and share of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUTERS = {"zaya": ["model.router=zaya", "model.router_skip_expert=false"],
           "zaya+skip": ["model.router=zaya", "model.router_skip_expert=true", "model.router_skip_bias_init=0.0"],
           "linear": ["model.router=linear"]}


def rank_main(out: Path, profile: tuple[int, int] | None, overrides: list[str]) -> None:
    """One rank's training run (under torchrun); writes rank-<r>.json with its expert bytes (and profile)."""
    import torch
    from torch.distributed.tensor import DTensor

    from zaya.config import load_config
    from zaya.train.callbacks import Callback
    from zaya.train.trainer import train

    torch.set_num_threads(1)
    config = load_config(str(ROOT / "configs" / "tiny.toml"), overrides)
    result: dict = {}

    class Measure(Callback):
        """Expert bytes at the end; with ``profile`` = (first, last), the profiler over those steps."""

        def __init__(self) -> None:
            self.prof = None

        def on_step_start(self, trainer, step: int) -> None:
            if profile and step == profile[0]:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()

        def on_step_end(self, trainer, record: dict) -> None:
            if self.prof is not None and record.get("step") == profile[1]:
                self.prof.__exit__(None, None, None)
                events = self.prof.key_averages()
                exchange = sum(e.self_cpu_time_total for e in events
                               if any(k in e.key for k in ("all_to_all", "alltoall", "wait_tensor")))
                result["exchange_us"] = exchange
                self.prof = None

        def on_stop(self, trainer, summary: dict) -> None:
            if self.prof is not None:  # fewer steps than the profile's last
                self.prof.__exit__(None, None, None)
                self.prof = None
            def local(t: torch.Tensor) -> torch.Tensor:  # an FSDP2 DTensor's own shard, not its whole size
                return t.to_local() if isinstance(t, DTensor) else t

            experts = [p for n, p in trainer.parallel.model.named_parameters() if ".experts." in n]
            ids = {id(p) for p in experts}
            state = [local(t) for opt in trainer.optimizers for p, s in opt.state.items() if id(p) in ids
                     for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
            experts = [local(p) for p in experts]
            result["weights"] = sum(p.numel() * p.element_size() for p in experts)
            result["state"] = sum(t.numel() * t.element_size() for t in state)

    train(config, callbacks=[Measure()])
    (out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(result))


def run_case(world: int, ep: int, parallel: str, router: str, args, tmp: Path, *, profile: tuple[int, int] | None,
             extra: list[str] = (), tag: str = "") -> dict:
    """One torchrun launch of ``world`` ranks; its losses, rank 0's expert bytes, the median step time (after two
    steps, the profiled ones left out) and, with ``profile`` = (first, last step), the all-to-all's time in them."""
    run = tmp / f"{world}-{ep}-{parallel}-{router}{tag}"
    run.mkdir()
    sets = ROUTERS[router] + [
        f"train.expert_parallel={ep}", f"train.parallel={parallel}", f"train.max_steps={args.steps}",
        f"train.micro_batch_size={args.micro_batch}", f"train.seq_len={args.seq_len}", "train.dtype=float32",
        "train.device=cpu", "train.eval_every=0", "train.sample_tokens=0", "train.router_probe=false",
        "train.log_every=1000", "optim.muon_ns_dtype=float32", "checkpoint.every=0", "checkpoint.ram_tier=false",
        f"train.run_dir={run / 'run'}", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(Path(__file__).resolve()), "--rank-out", str(run)]
    cmd += ["--profile-steps", f"{profile[0]}:{profile[1]}"] if profile else []
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"case {world}:{ep}:{parallel}:{router} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r.get("kind") == "train"]
    ranks = [json.loads((run / f"rank-{r}.json").read_text()) for r in range(world)]
    profiled = range(profile[0], profile[1] + 1) if profile else range(0)
    step_s = statistics.median(r["step_time_s"] for r in train_records[2:] if r["step"] not in profiled)
    out = {"losses": [r["loss"] for r in train_records], "weights": ranks[0]["weights"], "state": ranks[0]["state"],
           "step_s": step_s, "skip_share": statistics.mean(statistics.mean(r["skip_fraction"]) for r in train_records)
           if "skip_fraction" in train_records[0] else None}
    if "exchange_us" in ranks[0]:
        wall = sum(r["step_time_s"] for r in train_records if r["step"] in profiled)
        out["exchange_share"] = ranks[0]["exchange_us"] / 1e6 / wall
        out["exchange_s_per_step"] = ranks[0]["exchange_us"] / 1e6 / len(profiled)
    return out


def predicted_exchange(args, tmp: Path) -> dict:
    """``zaya tune comm``'s all-to-all over ``--ep`` of ``--world`` ranks on this machine (a sweep around the message
    size) priced for one step of the benchmark's shape, as ``zaya tune comm --config`` prices a config's."""
    from zaya.config import load_config
    from zaya.tune.comm import all_to_all_points, expert_all_to_all, price_all_to_all

    mc = load_config(str(ROOT / "configs" / "tiny.toml"), args.model_set).model
    exchange = expert_all_to_all(mc.num_layers, mc.top_k, mc.hidden_size, args.micro_batch * args.seq_len, 1, 4,
                                 args.ep)  # fp32, one micro-batch a step
    message = int(exchange["message_bytes"])
    cmd = [sys.executable, "-m", "zaya", "tune", "comm", "--nproc", str(args.world), "--ranks", str(args.ep),
           "--sizes", f"4K..{message * 8}", "--json", "--no-save", "--no-plot",
           "--out", str(tmp / "comm")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"zaya tune comm failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = json.loads(proc.stdout)["rows"]
    per, note = price_all_to_all(all_to_all_points(rows), args.ep, message)
    smallest = min((r for r in rows if r["op"] == "all_to_all" and r.get("time_s")), key=lambda r: r["bytes"])
    return {**exchange, "seconds": exchange["exchanges"] * per, "priced_from": note, "command": " ".join(cmd[2:]),
            "counts_seconds": mc.num_layers * smallest["time_s"]}  # each layer's counts: one smallest all-to-all


def compare_step_time(args, tmp: Path) -> dict:
    """``--rounds`` alternated runs of ZeRO-1 without and with expert parallelism (see the module docstring)."""
    last = args.steps
    profile = (last - 3, last)
    rounds, prediction = [], None
    for i in range(args.rounds):
        if i == args.rounds // 2:
            prediction = predicted_exchange(args, tmp)
        runs = {}
        for ep in ((1, args.ep) if i % 2 == 0 else (args.ep, 1)):
            runs[ep] = run_case(args.world, ep, "zero1", args.router, args, tmp, tag=f"-round{i}",
                                profile=profile if ep > 1 else None, extra=args.model_set)
        base, sharded = runs[1], runs[args.ep]
        rounds.append({"zero1_s": round(base["step_s"], 4), "ep_s": round(sharded["step_s"], 4),
                       "ratio": round(base["step_s"] / sharded["step_s"], 3),
                       "exchange_ms": round(sharded["exchange_s_per_step"] * 1e3, 1),
                       "exchange_share": round(sharded["exchange_share"], 3)})
        print(json.dumps({"round": i, **rounds[-1]}), file=sys.stderr, flush=True)
    ratios = [r["ratio"] for r in rounds]
    ep_s = statistics.median(r["ep_s"] for r in rounds)
    measured = statistics.median(r["exchange_ms"] for r in rounds)
    return {"compare": f"{args.world} ranks: zero1 vs zero1 + expert_parallel={args.ep}", "model_set": args.model_set,
            "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
            "timed_steps": f"3-{profile[0] - 1}", "rounds": rounds, "ratio_median": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "zero1_s_median": statistics.median(r["zero1_s"] for r in rounds),
            "ep_s_median": ep_s, "exchange_ms_measured": measured,
            "exchange_share_measured": statistics.median(r["exchange_share"] for r in rounds),
            "exchange_ms_predicted": round(prediction["seconds"] * 1e3, 1),
            "exchange_share_predicted": round(prediction["seconds"] / ep_s, 3),
            "predicted_over_measured": round(prediction["seconds"] * 1e3 / measured, 2),
            "counts_ms_predicted": round(prediction["counts_seconds"] * 1e3, 1),
            "exchange": {k: prediction[k] for k in ("message_bytes", "exchanges", "bytes", "priced_from", "command")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="2:2:zero1:zaya+skip,2:2:ddp:zaya,2:2:ddp:linear,4:2:zero1:zaya+skip,"
                                           "4:4:ddp:zaya,4:4:zero1:linear")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="profile steps 5-8 of the cases' runs")
    parser.add_argument("--rounds", type=int, default=0,
                        help="instead of the cases: this many rounds of ZeRO-1 against ZeRO-1 at --ep (step time)")
    parser.add_argument("--world", type=int, default=4, help="ranks of the step-time comparison")
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel degree of the step-time comparison")
    parser.add_argument("--router", default="zaya", choices=ROUTERS, help="router of the step-time comparison")
    parser.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of the step-time comparison's shape (repeatable)")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--rank-out")
    parser.add_argument("--profile-steps")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    if args.rank_out:
        first, _, last = (args.profile_steps or "").partition(":")
        rank_main(Path(args.rank_out), (int(first), int(last)) if args.profile_steps else None, args.set)
        return
    with tempfile.TemporaryDirectory(prefix="zaya-ep-") as tmp:
        if args.rounds:
            print(json.dumps(compare_step_time(args, Path(tmp))), flush=True)
            return
        profile = (5, 8) if args.profile else None
        for case in args.cases.split(","):
            world, ep, parallel, router = case.split(":")
            world, ep = int(world), int(ep)
            base = run_case(world, 1, parallel, router, args, Path(tmp), profile=profile)
            sharded = run_case(world, ep, parallel, router, args, Path(tmp), profile=profile)
            diffs = [abs(a - b) / abs(b) for a, b in zip(sharded["losses"], base["losses"])]
            row = {"case": case, "steps": len(diffs), "max_rel_loss_diff": max(diffs),
                   "expert_weight_bytes": [base["weights"], sharded["weights"]],
                   "expert_state_bytes": [base["state"], sharded["state"]],
                   "ratio": [base["weights"] / sharded["weights"], base["state"] / max(1, sharded["state"])],
                   "step_s": [round(base["step_s"], 4), round(sharded["step_s"], 4)],
                   "skip_share": sharded["skip_share"]}
            if "exchange_share" in sharded:
                row["exchange_share"] = round(sharded["exchange_share"], 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
