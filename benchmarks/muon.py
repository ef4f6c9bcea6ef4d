"""One Muon step over ZAYA1-base-shaped matrices: ``zaya.optim.Muon`` against ``torch.optim.Muon``.

Parameter set, per layer (ZAYA1-base): 16 experts of 4096x2048 and 16 of 2048x2048 (stacked 3-D ``[E, out, in]``
for ours), attention 1024x2048, 256x2048, 2 x 128x2048 and 2048x1024, router 256x2048 and 2 x 256x256. torch gets
the same matrices as 2-D parameters (each expert its own parameter; its gradients are views of ours), with the same
initial values, gradients and arguments (lr 0.02, weight decay 0.1, momentum 0.95, Nesterov, "match_rms_adamw",
bf16 Newton-Schulz).

Timed: ``optimizer.step()`` after a warm-up step (which allocates the momentum buffers and ours' workspace), ours
and torch alternating step by step; the figures are medians over ``--repeats`` steps. Before every timed step the
script waits (up to a minute) until the machine is idle (< 10% CPU busy over 0.5 s) because it is shared.

* ``ours_s``, ``torch_s``, ``speedup`` = torch_s / ours_s, same process, default threads; ``speedup_paired`` is
  the median of the per-repeat ratios (each torch step over the ours step just before it), less sensitive to
  other work starting between steps.
* ``max_rel_diff`` / ``median_rel_diff``: after the warm-up step (both from the same parameters), per matrix
  ``||dp_ours - dp_torch||_F / ||dp_torch||_F`` over the parameter changes ``dp``.
* ``world2_per_rank_s``: 2 gloo ranks on this machine, each with 1 thread (one core each), DDP-style replicated
  parameters with ``replica_group=WORLD`` (each matrix orthogonalised by one rank, results broadcast): the wall
  time of a step (both ranks start together after a barrier; the slower rank's time), median over the repeats.
  ``ours_1thread_s`` is the single-process step with 1 thread, the same resources one rank has, and
  ``world2_ratio`` = world2_per_rank_s / ours_1thread_s (the per-rank share of the work, communication included).
  ``world2_ratio_vs_ours_s`` divides by ``ours_s`` (2 threads) instead.

Run: ``PYTHONPATH=src python benchmarks/muon.py [--layers N] [--experts E] [--repeats R] [--quick] [--no-world2]
[--device cuda]``. Human-readable lines go to stderr, one JSON line to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

import torch

import quiet  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import torch.distributed as dist
import torch.multiprocessing as mp

from zaya.optim import Muon
from zaya.optim.newton_schulz import ns_flops

KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def layer_shapes(experts: int) -> list[tuple[int, ...]]:
    return [(experts, 4096, 2048), (experts, 2048, 2048),  # MoE experts
            (1024, 2048), (256, 2048), (128, 2048), (128, 2048), (2048, 1024),  # attention
            (256, 2048), (256, 256), (256, 256)]  # router


def torch_flops(shapes: list[tuple[int, ...]]) -> float:
    """FLOPs of torch's NS (5 steps) for the matrices: the work both optimizers are asked to do."""
    total = 0.0
    for s in shapes:
        k = s[0] if len(s) == 3 else 1
        total += k * ns_flops(s[-2], s[-1], 5, "reference")
    return total


def make_set(shapes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    return params, grads


def wait_quiet(device: torch.device, max_busy: float = 0.10, timeout: float = 120.0) -> bool:
    return device.type != "cpu" or quiet.wait_quiet(max_busy, timeout)


def timed_step(opt, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_single(shapes, repeats, device, compare_torch=True, threads=None):
    """(ours times, torch times, rel diffs, gram fallbacks)."""
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        ours_p, grads = make_set(shapes, device)
        for p, g in zip(ours_p, grads):
            p.grad = g
        ours = Muon(ours_p, **KW)
        torch_opt = None
        if compare_torch:
            torch_p, torch_g = [], []
            for p, g in zip(ours_p, grads):
                if p.ndim == 3:
                    torch_p += [torch.nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])]
                    torch_g += [g[e] for e in range(p.shape[0])]
                else:
                    torch_p.append(torch.nn.Parameter(p.detach().clone()))
                    torch_g.append(g)
            for p, g in zip(torch_p, torch_g):
                p.grad = g
            torch_opt = torch.optim.Muon(torch_p, **KW)
            init = [p.detach().clone() for p in torch_p]
        # Warm-up step, and the agreement check on its result.
        t = timed_step(ours, device)
        say(f"  warm-up: ours {t:.2f} s")
        diffs = []
        if torch_opt is not None:
            t = timed_step(torch_opt, device)
            say(f"  warm-up: torch {t:.2f} s")
            ours_mats = [m for p in ours_p for m in (p.detach().unbind(0) if p.ndim == 3 else [p.detach()])]
            for mo, mt, m0 in zip(ours_mats, torch_p, init):
                dt = mt.detach() - m0
                diffs.append(float((mo - m0 - dt).double().norm() / dt.double().norm()))
            del init
        ours_t, torch_t = [], []
        for r in range(repeats):
            quiet = wait_quiet(device)
            ours_t.append(timed_step(ours, device))
            line = f"  step {r + 1}/{repeats}: ours {ours_t[-1]:.2f} s"
            if torch_opt is not None:
                quiet = wait_quiet(device) and quiet
                torch_t.append(timed_step(torch_opt, device))
                line += f", torch {torch_t[-1]:.2f} s (ratio {torch_t[-1] / ours_t[-1]:.2f})"
            say(line + ("" if quiet else "  [machine not idle]"))
        return ours_t, torch_t, diffs, ours.gram_fallbacks
    finally:
        torch.set_num_threads(old_threads)


def _world2_worker(rank: int, world: int, port: int, shapes, repeats: int, result) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        params, grads = make_set(shapes, torch.device("cpu"))
        for p, g in zip(params, grads):
            p.grad = g
        opt = Muon(params, **KW, replica_group=dist.group.WORLD)
        times, counts = [], []
        for r in range(repeats + 1):  # the first is the warm-up
            flag = torch.tensor([1.0 if rank != 0 else float(wait_quiet(torch.device("cpu")))])
            dist.broadcast(flag, 0)
            dist.barrier()
            t = time.perf_counter()
            opt.step()
            t = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r:
                times.append(float(t))
            counts.append(opt.ns_matrices)
        result[rank] = {"times": times, "ns_matrices": counts[-1]}
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=1, help="ZAYA1-base layers in the parameter set (default 1)")
    p.add_argument("--experts", type=int, default=16, help="experts per layer (ZAYA1-base: 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per optimizer (after one warm-up)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 experts, 1 repeat")
    p.add_argument("--no-world2", action="store_true", help="skip the 2-rank measurement")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.quick:
        args.experts, args.repeats = 2, 1
    device = torch.device(args.device)
    shapes = layer_shapes(args.experts) * args.layers
    flops = torch_flops(shapes)
    matrices = sum(s[0] if len(s) == 3 else 1 for s in shapes)
    say(f"# {args.layers} layer(s), {args.experts} experts: {matrices} matrices, torch's NS = {flops / 1e12:.2f} "
        f"TFLOP per step; {torch.get_num_threads()} threads, device {device}, torch {torch.__version__}")
    t0 = time.time()
    ours_t, torch_t, diffs, fallbacks = bench_single(shapes, args.repeats, device)
    ours_s, torch_s = statistics.median(ours_t), statistics.median(torch_t)
    say(f"ours {ours_s:.2f} s, torch {torch_s:.2f} s: speedup {torch_s / ours_s:.2f}; torch at "
        f"{flops / torch_s / 1e9:.0f} GFLOP/s; update difference max {max(diffs):.4f}, median "
        f"{statistics.median(diffs):.4f}")
    paired = statistics.median(t / o for t, o in zip(torch_t, ours_t))
    out = {"ours_s": round(ours_s, 3), "torch_s": round(torch_s, 3), "speedup": round(torch_s / ours_s, 3),
           "speedup_paired": round(paired, 3)}
    say(f"paired speedup (median of per-step ratios): {paired:.2f}")
    if device.type == "cpu" and not args.no_world2:
        say("# single process, 1 thread")
        one_t, _, _, _ = bench_single(shapes, args.repeats, device, compare_torch=False, threads=1)
        one_s = statistics.median(one_t)
        say(f"ours, 1 thread: {one_s:.2f} s")
        say("# 2 gloo ranks, 1 thread each")
        with mp.Manager() as manager:
            result = manager.dict()
            mp.spawn(_world2_worker, args=(2, free_port(), shapes, args.repeats, result), nprocs=2, join=True)
            w2 = [dict(result[r]) for r in range(2)]
        w2_s = statistics.median(w2[0]["times"])
        say(f"2 ranks: per-rank step {w2_s:.2f} s (steps {[round(t, 2) for t in w2[0]['times']]}), matrices "
            f"per rank {[w['ns_matrices'] for w in w2]}; ratio to 1 thread {w2_s / one_s:.2f}, to ours_s "
            f"{w2_s / ours_s:.2f}")
        out.update(world2_per_rank_s=round(w2_s, 3), ours_1thread_s=round(one_s, 3),
                   world2_ratio=round(w2_s / one_s, 3), world2_ratio_vs_ours_s=round(w2_s / ours_s, 3),
                   world2_matrices_per_rank=[w["ns_matrices"] for w in w2])
    else:
        out["world2_per_rank_s"] = None
    out.update(max_rel_diff=round(max(diffs), 5), median_rel_diff=round(statistics.median(diffs), 5),
               gram_fallbacks=fallbacks, torch_tflop=round(flops / 1e12, 3),
               torch_gflops=round(flops / torch_s / 1e9, 1), layers=args.layers, experts=args.experts,
               matrices=matrices, repeats=args.repeats, threads=torch.get_num_threads(), device=str(device),
               ours_steps=[round(t, 3) for t in ours_t], torch_steps=[round(t, 3) for t in torch_t],
               seconds=round(time.time() - t0, 1))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
