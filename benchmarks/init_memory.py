"""Peak resident memory of ``train.init_from`` from a ZAYA1-width checkpoint: 2 gloo ranks under FSDP2 against the
full state's size, and one process as the comparison.

The checkpoint: a zaya model of ZAYA1's width (hidden 2048, the full 262,272-entry vocabulary, tied embedding, 8
query / 2 KV heads of 128, router width 256) with ``--layers`` layers (2) of ``--experts`` experts (4) of width 2048,
random weights (zaya's own init), cast to bfloat16 as the released weights are, written in the Hugging Face layout
by ``zaya.model.hf.save_hf`` in shards of ``--shard-mb`` (256 MB; the 1 GB embedding is a shard of its own). The
*full state* is the training model's: every parameter and buffer in fp32, as ``init_from`` holds it.

Each measurement is a fresh interpreter (``sys.executable`` running this file with ``--child``), one thread,
joining a gloo group on 127.0.0.1 when there are two ranks (the variables torchrun sets). A ``load`` rank does what
``zaya train --init-from`` does before its first step: ``open_source`` (rank 0 verifies the checksums and reads the
headers), ``build_model(weights_later=True)`` (meta device, FSDP2 ``fully_shard``, ``to_empty``) and
``load_weights``, then checks that its shard of the embedding equals the file's rows. A ``baseline`` rank imports
the same modules and joins the same group, and builds nothing. Each reports its peak resident set, file pages it
mapped included: ``VmHWM`` of /proc/self/status (``ru_maxrss`` is not used: Linux carries it over from the parent
across fork and exec). The checkpoint is written by a child too, so the parent never holds much. Figures: per rank ``peak - baseline`` (the baseline of the same world size, max over
its ranks), and its ratio to the full state; the target under FSDP2 is at most 0.6.

Run: ``PYTHONPATH=src python benchmarks/init_memory.py [--dir DIR] [--layers N] [--experts N]``; prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_checkpoint(directory: Path, layers: int, experts: int, shard_mb: int) -> dict:
    import torch

    from zaya.config import ModelConfig
    from zaya.model import ZayaForCausalLM
    from zaya.model.hf import save_hf

    config = ModelConfig(num_layers=layers, num_experts=experts)  # the defaults are ZAYA1-base's shape
    torch.manual_seed(0)
    model = ZayaForCausalLM(config)
    state_bytes = sum(t.numel() * 4 for t in model.state_dict().values())
    model = model.to(torch.bfloat16)
    save_hf(model, directory, max_shard_bytes=shard_mb << 20)
    files = sorted(directory.glob("*.safetensors"))
    return {"full_state_fp32_bytes": state_bytes, "checkpoint_bytes": sum(f.stat().st_size for f in files),
            "files": len(files)}


def child(mode: str, source: str) -> None:
    import torch

    from zaya.checkpoint.init_from import load_weights, merged_model_config, open_source
    from zaya.config import Config, ModelConfig, TrainConfig
    from zaya.distributed.runtime import start, stop
    from zaya.train.build import build_model

    torch.set_num_threads(1)
    rt = start(1800.0, 600.0, "cpu")
    out = {"rank": rt.rank, "mode": mode}
    if mode == "load":
        t0 = time.perf_counter()
        init = open_source(source, rt, lambda m: None)
        config = Config(model=merged_model_config(ModelConfig(), init),
                        train=TrainConfig(parallel="fsdp", dtype="float32"))
        parallel = build_model(config, rt, weights_later=True)
        load_weights(init, parallel.wrapped, rt)
        out["load_s"] = time.perf_counter() - t0
        out["checked"] = check_embedding(parallel.model, init)
    rt.barrier()
    out["peak_rss_bytes"] = peak_rss()
    stop(rt)
    print(json.dumps(out), flush=True)


def peak_rss() -> int:
    """This process's peak resident set (``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/self/status (this benchmark needs Linux)")


def check_embedding(model, init) -> bool:
    """This rank's rows of the embedding (all of them in one process) equal the file's."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weight = model.embed.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    start = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)[1][0] \
        if isinstance(weight, DTensor) else 0
    file = next(f for f, name, _ in init.tensors if name == "model.embed_tokens.weight")
    rows = min(64, local.shape[0])
    with safe_open(file, framework="pt") as f:
        expected = f.get_slice("model.embed_tokens.weight")[start:start + rows]
    return bool((local[:rows] == expected.float()).all())


def run(world: int, mode: str, source: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", mode, "--source", str(source), *extra],
                                      env=env, stdout=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"a {mode} rank failed (exit {p.returncode})")
        rows.append(json.loads(stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where the checkpoint is written (default: a new temporary directory)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--child", choices=("load", "baseline", "write"), help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "write":
        print(json.dumps(write_checkpoint(Path(args.source), args.layers, args.experts, args.shard_mb)), flush=True)
        return
    if args.child:
        child(args.child, args.source)
        return
    root = Path(tempfile.mkdtemp(prefix="zaya-init-bench-", dir=args.dir))
    try:
        source = root / "hf"
        (result,) = run(1, "write", source, ("--layers", str(args.layers), "--experts", str(args.experts),
                                             "--shard-mb", str(args.shard_mb)))
        result.update(layers=args.layers, experts=args.experts)
        full = result["full_state_fp32_bytes"]
        for world, name in ((2, "fsdp_2_ranks"), (1, "one_process")):
            base = max(r["peak_rss_bytes"] for r in run(world, "baseline", source))
            loads = run(world, "load", source)
            assert all(r["checked"] for r in loads), "a rank's embedding differs from the file"
            extra = max(r["peak_rss_bytes"] for r in loads) - base
            result[name] = {"baseline_rss_bytes": base, "peak_rss_bytes": [r["peak_rss_bytes"] for r in loads],
                            "peak_minus_baseline_bytes": extra, "ratio_to_full_state": round(extra / full, 3),
                            "load_s": round(max(r["load_s"] for r in loads), 1)}
        result["target_met"] = result["fsdp_2_ranks"]["ratio_to_full_state"] <= 0.6
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
