"""Planner validation: ``zaya plan``'s memory estimate against the measured peak of real CPU training runs.

Each case is a real ``Trainer`` (the code ``zaya train`` runs: data loader, DDP / ZeRO-1 / FSDP2 wrapping, Muon +
AdamW, the routing probe) on 2 gloo ranks on this machine, built and stepped inside ``zaya.tune.live_memory.
LiveMemory``, which counts every tensor storage the rank's thread creates, from before the model exists (the CPU's
stand-in for ``torch.cuda.max_memory_allocated``). Measured: the peak over the second optimizer step (the optimizer
state exists from the first), its forward/backward part and its optimizer part, and what is alive between steps.
Estimated: ``zaya.tune.plan.memory_plan`` for the same config, mode and world size. Reported per case: both peaks
and their ratio; the target is |estimate / measured - 1| <= 15 %.

    python benchmarks/planner_validation.py          # 3 shapes x (ddp, zero1, fsdp) in fp32; tiny in bf16; one rank
    python benchmarks/planner_validation.py --quick     # 3 shapes x (zero1, fsdp), fp32 (the test's set)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

BASE = ROOT / "configs" / "tiny.toml"
COMMON = ["train.eval_every=0", 'train.sample_prompt=""', "checkpoint.every=1000", "checkpoint.ram_tier=false",
          "train.log_every=1000", "train.max_steps=1000", "optim.muon_ns_dtype=\"float32\""]

# Three shapes that differ where memory differs: width and vocabulary, depth and experts, router, attention kind,
# sequence length and micro-batch.
SHAPES = {
    "tiny": [],  # configs/tiny.toml: d 256, 4 layers, 8 experts x 512, CCA, ZAYA router, 16 x 128 tokens
    "wide": ["model.hidden_size=384", "model.num_layers=2", "model.num_query_heads=6", "model.num_kv_heads=2",
             "model.head_dim=64", "model.num_experts=4", "model.expert_hidden_size=1024",
             "train.micro_batch_size=4", "train.seq_len=256", "model.max_seq_len=256"],
    "deep": ["model.hidden_size=128", "model.num_layers=8", "model.num_query_heads=4", "model.num_kv_heads=4",
             "model.head_dim=32", "model.attention=\"gqa\"", "model.router=\"linear\"", "model.num_experts=16",
             "model.expert_hidden_size=256", "train.micro_batch_size=2", "train.seq_len=512",
             "model.max_seq_len=512"],
}


def case_overrides(shape: str, mode: str, dtype: str, run_dir: str, dataset: str | None) -> list[str]:
    out = COMMON + SHAPES[shape] + [f'train.parallel="{mode}"', f'train.dtype="{dtype}"',
                                    f"train.run_dir={json.dumps(run_dir)}"]
    if dataset is not None:  # a prepared dataset (tests: 512-entry vocabulary)
        out += [f"data.datasets={{ d = {json.dumps(dataset)} }}", "model.vocab_size=512", "model.eos_token_id=2"]
    return out


def _measure(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """On one rank (the process group's environment set, as torchrun sets it): each case's measured peaks (bytes)."""
    import torch

    from zaya.config import load_config
    from zaya.distributed.runtime import start, stop
    from zaya.train.trainer import Trainer
    from zaya.tune.live_memory import LiveMemory

    results = []
    rt = start(600.0, 120.0, "cpu")
    try:
        for case in cases:
            config = load_config(BASE, case["overrides"])
            torch.manual_seed(0)
            with LiveMemory("cpu") as mem:
                trainer = Trainer.build(config, rt, resume="never")
                try:
                    marks: dict[str, int] = {}
                    for opt in trainer.optimizers:
                        step = opt.step

                        def wrapped(*a, _step=step, **k):
                            marks.setdefault("before_optimizer", mem.peak)
                            mem.reset_peak()
                            return _step(*a, **k)

                        opt.step = wrapped
                    for _ in range(2):  # the first step allocates the optimizer state; the second is steady
                        marks.clear()
                        mem.reset_peak()
                        start_bytes = mem.current
                        trainer.step()
                    results.append({"name": case["name"], "between_steps": start_bytes,
                                    "forward_backward": marks["before_optimizer"], "optimizer": mem.peak,
                                    "peak": max(marks["before_optimizer"], mem.peak)})
                finally:
                    trainer.close()
    finally:
        stop(rt)
    return results


def _worker(rank: int, world: int, port: int, fn, args: tuple, out_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    try:
        value = {"value": fn(rank, world, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        value = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(value))


def spawn_ranks(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; their (JSON) values in rank order."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, port, fn, args, out_dir), nprocs=world, start_method="spawn")
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    for r, value in enumerate(per_rank):
        if "error" in value:
            raise RuntimeError(f"rank {r}: {value['error']}")
    return [value["value"] for value in per_rank]


def measure(cases: list[dict], world: int = 2, launch=spawn_ranks) -> list[dict]:
    """Run ``cases`` on ``world`` gloo ranks started by ``launch`` (``launch(fn, world, *args)``: the values of
    ``fn(rank, world, *args)`` in rank order; the tests' launcher forks them from a server that imported torch);
    per case the largest peak over the ranks."""
    per_rank = launch(_measure, world, cases)
    merged = []
    for i, case in enumerate(cases):
        rows = [value[i] for value in per_rank]
        merged.append({k: (max(row[k] for row in rows) if k != "name" else case["name"]) for k in rows[0]})
    return merged


def estimate(case: dict, world: int) -> dict:
    from zaya.config import load_config
    from zaya.tune.plan import memory_plan

    config = load_config(BASE, case["overrides"])
    tc = config.train
    return memory_plan(config, gpus=world, parallel=tc.parallel, micro_batch=tc.micro_batch_size,
                       seq_len=tc.seq_len, cp=1, activation_checkpointing=tc.activation_checkpointing,
                       device_type="cpu")


def build_cases(shapes: list[str], modes: list[str], dtype: str, root: str, dataset: str | None) -> list[dict]:
    return [{"name": f"{shape}/{mode}/{dtype}", "shape": shape, "mode": mode, "dtype": dtype,
             "overrides": case_overrides(shape, mode, dtype, f"{root}/{shape}-{mode}-{dtype}", dataset)}
            for shape in shapes for mode in modes]


def validate(cases: list[dict], world: int = 2, launch=spawn_ranks) -> list[dict]:
    measured = measure(cases, world, launch)
    rows = []
    for case, m in zip(cases, measured):
        est = estimate(case, world)
        rows.append({"case": case["name"], "measured_peak": m["peak"], "estimated_peak": est["peak"],
                     "ratio": est["peak"] / m["peak"], "measured": m,
                     "estimated": {"persistent": est["persistent"], "forward_backward": est["forward_backward"],
                                   "optimizer": est["optimizer_step"], "peak": est["peak"]}})
    return rows


def table(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| case (shape/mode/dtype) | measured peak MiB | estimated MiB | estimate / measured | measured fwd+bwd "
             "/ optimizer MiB | estimated fwd+bwd / optimizer MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        m, e = r["measured"], r["estimated"]
        lines.append(f"| {r['case']} | {r['measured_peak'] / mib:.1f} | {r['estimated_peak'] / mib:.1f} | "
                     f"{r['ratio']:.3f} | {m['forward_backward'] / mib:.1f} / {m['optimizer'] / mib:.1f} | "
                     f"{e['forward_backward'] / mib:.1f} / {e['optimizer'] / mib:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 shapes x (zero1, fsdp) in fp32 only")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        if args.quick:
            cases = build_cases(list(SHAPES), ["zero1", "fsdp"], "float32", root, None)
        else:
            cases = build_cases(list(SHAPES), ["ddp", "zero1", "fsdp"], "float32", root, None)
            cases += build_cases(["tiny"], ["zero1", "fsdp"], "bfloat16", root, None)
        rows = validate(cases)
        if not args.quick:  # one process: no wrapper, the gradients live only from the backward to the step
            single = build_cases(["tiny"], ["ddp"], "float32", f"{root}/one-rank", None)
            for row in validate(single, world=1):
                row["case"] += " (1 rank)"
                rows.append(row)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    print(table(rows))
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"worst |estimate / measured - 1| = {worst:.1%} (target <= 15%)")
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
