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
* ``step_s``: the median step time after the first two steps (metrics.jsonl's step_time_s), at both degrees;
* ``exchange_share``: with ``--profile``, the share of steps 5-8's wall time (rank 0, torch.profiler over CPU ops)
  spent in the all-to-all operators (every operator whose name holds ``all_to_all``, ``alltoall`` or
  ``wait_tensor``, self time: the exchanges' launch and the waits for them).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/expert_parallel.py [--cases 2:2:zero1:zaya,...] [--profile]``;
one JSON line per case. Cases are ``world:ep:parallel:router`` (router ``zaya``, ``zaya+skip`` (skip bias 0, so
tokens take it), or ``linear``).
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


def rank_main(out: Path, profile: bool, overrides: list[str]) -> None:
    """One rank's training run (under torchrun); writes rank-<r>.json with its expert bytes (and profile)."""
    import torch

    from zaya.config import load_config
    from zaya.train.callbacks import Callback
    from zaya.train.trainer import train

    torch.set_num_threads(1)
    config = load_config(str(ROOT / "configs" / "tiny.toml"), overrides)
    result: dict = {}

    class Measure(Callback):
        """Expert bytes at the end; with ``profile``, the profiler over steps 5-8."""

        def __init__(self) -> None:
            self.prof = None

        def on_step_start(self, trainer, step: int) -> None:
            if profile and step == 5:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()

        def on_step_end(self, trainer, record: dict) -> None:
            if self.prof is not None and record.get("step") == 8:
                self.prof.__exit__(None, None, None)
                events = self.prof.key_averages()
                exchange = sum(e.self_cpu_time_total for e in events
                               if any(k in e.key for k in ("all_to_all", "alltoall", "wait_tensor")))
                result["exchange_us"] = exchange
                self.prof = None

        def on_stop(self, trainer, summary: dict) -> None:
            if self.prof is not None:  # fewer than 8 steps
                self.prof.__exit__(None, None, None)
                self.prof = None
            experts = [p for n, p in trainer.parallel.model.named_parameters() if ".experts." in n]
            ids = {id(p) for p in experts}
            state = [t for opt in trainer.optimizers for p, s in opt.state.items() if id(p) in ids
                     for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
            result["weights"] = sum(p.numel() * p.element_size() for p in experts)
            result["state"] = sum(t.numel() * t.element_size() for t in state)

    train(config, callbacks=[Measure()])
    (out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(result))


def run_case(world: int, ep: int, parallel: str, router: str, args, tmp: Path) -> dict:
    run = tmp / f"{world}-{ep}-{parallel}-{router}"
    run.mkdir()
    sets = ROUTERS[router] + [
        f"train.expert_parallel={ep}", f"train.parallel={parallel}", f"train.max_steps={args.steps}",
        f"train.micro_batch_size={args.micro_batch}", f"train.seq_len={args.seq_len}", "train.dtype=float32",
        "train.device=cpu", "train.eval_every=0", "train.sample_tokens=0", "train.router_probe=false",
        "train.log_every=1000", "optim.muon_ns_dtype=float32", "checkpoint.every=0", "checkpoint.ram_tier=false",
        f"train.run_dir={run / 'run'}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(Path(__file__).resolve()), "--rank-out", str(run)] + (["--profile"] if args.profile else [])
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"case {world}:{ep}:{parallel}:{router} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r.get("kind") == "train"]
    ranks = [json.loads((run / f"rank-{r}.json").read_text()) for r in range(world)]
    step_s = statistics.median(r["step_time_s"] for r in train_records[2:])
    out = {"losses": [r["loss"] for r in train_records], "weights": ranks[0]["weights"], "state": ranks[0]["state"],
           "step_s": step_s, "skip_share": statistics.mean(statistics.mean(r["skip_fraction"]) for r in train_records)
           if "skip_fraction" in train_records[0] else None}
    if "exchange_us" in ranks[0]:
        out["exchange_share"] = ranks[0]["exchange_us"] / 1e6 / sum(r["step_time_s"] for r in train_records[4:8])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="2:2:zero1:zaya+skip,2:2:ddp:zaya,2:2:ddp:linear,4:2:zero1:zaya+skip,"
                                           "4:4:ddp:zaya,4:4:zero1:linear")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--rank-out")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    if args.rank_out:
        rank_main(Path(args.rank_out), args.profile, args.set)
        return
    with tempfile.TemporaryDirectory(prefix="zaya-ep-") as tmp:
        for case in args.cases.split(","):
            world, ep, parallel, router = case.split(":")
            world, ep = int(world), int(ep)
            base = run_case(world, 1, parallel, router, args, Path(tmp))
            sharded = run_case(world, ep, parallel, router, args, Path(tmp))
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
