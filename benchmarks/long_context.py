"""Long-context benchmarks (JSON lines): context-parallel training steps, and (delegated) tree vs ring decoding and
the CCA attention layer.

``--part cp`` (the default): the tiny model's widths at 8k and 16k tokens, one sequence, forward + backward + the
gradient all-reduce, in fresh processes: one process (the baseline, with and without activation checkpointing)
and 2 context-parallel ranks with each method. Per configuration: the median step time, the activation memory per
rank (the bytes autograd saved for the backward, counted once per storage, weights excepted: what context
parallelism divides) and
the growth of the peak resident memory during the steps. Ratios are against the one-process run of the same
length, measured in the same invocation. Each rank gets ``--threads`` intra-op threads (default 1): a rank stands
for one device, as context parallelism adds devices.

``--part decode`` runs ``benchmarks/tree_decoding.py``, ``--part cca`` ``benchmarks/cca_attention.py``;
``--part all`` all three.

    python benchmarks/long_context.py                       # cp at 8k and 16k tokens (a few minutes)
    python benchmarks/long_context.py --lengths 1024 --steps 2 --quick-model   # smoke run (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_config(seq_len: int, quick: bool):
    from zaya.config import ModelConfig

    table = tomllib.loads((ROOT / "configs/tiny.toml").read_text())["model"]
    table["max_seq_len"] = seq_len
    if quick:
        table.update(num_layers=2, hidden_size=64, expert_hidden_size=128, router_hidden_size=16, head_dim=32,
                     num_query_heads=2, num_kv_heads=2)
    return ModelConfig(**table)


def _rank(rank: int, world: int, port: int, job: dict, out_path: str) -> None:
    """One rank of one configuration: steps of forward + backward (+ gradient all-reduce across ranks)."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    from zaya.distributed.context_parallel import ContextParallelSequence, CPGroup, shard
    from zaya.model import ZayaForCausalLM

    torch.set_num_threads(job["threads"])
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    seq = job["seq_len"]
    model = ZayaForCausalLM(_model_config(seq, job["quick"]))
    model.activation_checkpointing = job["recompute"]
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq)[None]
    if world > 1:
        model.set_sequence_seam(ContextParallelSequence(CPGroup(None, rank, world), job["method"]))
        ids, positions = shard(ids, world, rank), shard(positions, world, rank)
    params = [p for p in model.parameters() if p.requires_grad]

    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}

    def pack(t):  # what autograd keeps for the backward, once per storage, weights excepted
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    times, activation = [], []
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for step in range(job["steps"] + 1):
        saved.clear()
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids, labels=ids, position_ids=positions)
        activation.append(sum(saved.values()))
        out.loss.backward()
        if world > 1:
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat)
        model.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
    rss_growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    row = {"rank": rank, "step_s": statistics.median(times), "activation_bytes": max(activation),
           "peak_rss_growth_mb": rss_growth_kb / 1024}
    Path(f"{out_path}.{rank}").write_text(json.dumps(row))
    if world > 1:
        dist.destroy_process_group()


def run_cp_config(job: dict, work: Path) -> dict:
    import torch.multiprocessing as mp

    world = job["world"]
    out = work / f"cp-{job['seq_len']}-{world}-{job['method']}-{int(job['recompute'])}"
    mp.start_processes(_rank, args=(world, _free_port(), job, str(out)), nprocs=world, start_method="forkserver")
    rows = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    return {"step_s": max(r["step_s"] for r in rows),
            "activation_mb_per_rank": max(r["activation_bytes"] for r in rows) / 2**20,
            "peak_rss_growth_mb_per_rank": max(r["peak_rss_growth_mb"] for r in rows)}


def part_cp(args: argparse.Namespace) -> None:
    import multiprocessing
    import tempfile

    # Every configuration's ranks are fresh processes forked from one server that imported torch and zaya once:
    # a configuration starts in a fraction of a second instead of seconds of imports per rank.
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "zaya.model",
                                            "zaya.distributed.context_parallel"])

    configs = [(1, "-", False), (1, "-", True), (2, "allgather", False), (2, "ring", False)]
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.lengths:
            baseline = None
            for world, method, recompute in configs:
                job = {"seq_len": seq, "world": world, "method": method, "recompute": recompute,
                       "steps": args.steps, "threads": args.threads, "quick": args.quick_model}
                row = {"part": "cp", "seq_len": seq, "ranks": world, "method": method,
                       "activation_checkpointing": recompute, **run_cp_config(job, Path(tmp))}
                if baseline is None:
                    baseline = row
                row["step_time_vs_one_process"] = round(row["step_s"] / baseline["step_s"], 3)
                row["activation_vs_one_process"] = round(row["activation_mb_per_rank"]
                                                         / baseline["activation_mb_per_rank"], 3)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["cp", "decode", "cca", "all"], default="cp")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384], help="sequence lengths (cp)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of each rank: a rank stands for one device, so the one-process "
                             "baseline gets one rank's share and 2 cp ranks twice that")
    parser.add_argument("--quick-model", action="store_true", help="a 2-layer, 64-wide model (smoke runs)")
    args = parser.parse_args()
    if args.part in ("cp", "all"):
        part_cp(args)
    for part, script in (("decode", "tree_decoding.py"), ("cca", "cca_attention.py")):
        if args.part in (part, "all"):
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], check=True)


if __name__ == "__main__":
    main()
