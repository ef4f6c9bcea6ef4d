"""Training tokens/s of zaya's ``ZayaForCausalLM`` against ``transformers``' ``ZayaForCausalLM``: same config, same
weights, same data, same optimizer, standard bf16 mixed precision.

Both models are built from one zaya ``ModelConfig`` (the HF config via ``zaya.model.hf.hf_config_from_model_config``,
the shape of configs/tiny.toml with 16 experts and a 4,096 vocabulary by default). zaya's model is initialised with a
fixed seed and its weights are copied into the HF model under the checkpoint name mapping
(``zaya.model.hf.hf_state_dict``; the tied LM head is the embedding in both). Token ids are drawn from
``[3, vocab)``, so that the padding id (0), whose embedding row HF's ``nn.Embedding(padding_idx=0)`` never updates, does
not occur and the two models train the same function.

One step, for each model: forward with labels (mean next-token cross-entropy over B x (T - 1) positions; zaya takes
labels already shifted, HF shifts them itself) under bf16 autocast on the benchmark's device, backward,
``clip_grad_norm_(1.0)``, ``torch.optim.AdamW.step()`` (same lr, betas, eps, weight decay, one parameter group; the
``fused`` or ``foreach`` implementation, whichever is faster for that model's parameters, measured first), and
``zero_grad()``. Weights and optimizer state stay fp32 (master weights); the matmuls run in bf16. zaya's own config
options are left at their defaults (``residual_fp32 = true``, the HF port's semantics).

HF runs with its defaults for a model built from a config: ``sdpa`` attention, ``grouped_mm`` experts. Its
``grouped_mm`` path casts activations to the weights' dtype (``grouped_mm`` has no autocast rule), so under autocast
its expert GEMMs run in fp32; it is therefore also timed with ``experts_implementation="eager"`` (a Python loop over
experts, bf16 GEMMs under autocast), and ``hf_tokens_per_s`` is the faster of the two. Each HF mode has its own copy
of the same initial weights and its own optimizer.

Routing state. With random tokens and no balancing update, top-1 routing collapses within a few steps at this lr:
by the fourth step nearly every token of every layer goes to one expert, in both models alike. That would time a
degenerate step (one expert's GEMMs; HF's eager loop runs once instead of 16 times), unlike any real run, where the
balancing biases keep the load spread. So by default every step after the first starts from the same state: after
each model's first step (from the shared init), its weights, buffers and AdamW state are snapshotted, and before
every later step they are copied back in place (outside the timed region). Every timed step is thus a "second step"
on a fresh batch, with the routing of an early training step (all 16 experts used; ``max_expert_load``, the largest
expert's share over the mean, per layer, about 3 to 7). ``--free-running`` times the plain trajectory instead.

Timing: ``--warmup`` steps of every model, then ``--steps`` rounds; each round runs one step of every model (and one
``PEAK_N``^3 bf16 matmul, the peak yardstick) back to back, so machine noise hits all alike. Figures are medians over
the rounds. Every model sees the same sequence of batches (one fresh batch per step, fixed seed). On a shared
machine, ``--quiet-below`` (default 0.1) makes each round first wait until other processes use at most that share of
the CPUs (sampled from /proc/stat over 0.5 s while this process sleeps), and times the round again (up to
``--max-redo`` times) when other processes used more than that share during it (the machine's busy time less this
process's CPU time): with 2 intra-op threads, a core taken by someone else stalls every OpenMP barrier and can
multiply step times several-fold.

Keys: ``ours_tokens_per_s`` / ``hf_tokens_per_s`` = B*T / median step time; ``speedup`` = their ratio;
``ours_flops_fraction_of_peak`` = 3 x forward matmul FLOPs per token (``zaya.model.info.forward_flops_per_token`` at
context T/2, summed) x ours_tokens_per_s / the peak matmul FLOP/s measured in the same rounds. ``*_first_loss``: the
loss of each model's first step (bf16 autocast, from the shared init); ``*_last_loss``: the loss of the last timed
step (the same state and batch for all); ``fp32_loss_*``: one fp32 forward of each on the first batch, before any
step (a tight parity check of the weight copy).

Device: ``--device`` (default ``auto``: the GPU when torch sees one, else the CPU; ``zaya.core.device.resolve_device``).
Both models, their optimizers, the data and the peak matmul live there, and autocast runs on that device's type. On
a GPU the device is synchronised before each timer is read, and the quiet-machine wait and re-timing above are
skipped (they guard CPU-bound timings; ``others_cpu_share_max`` is still reported).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/train_step.py [--steps N] [--warmup N] [--threads N] [--verbose]
[--profile] [--device D]``; ``--profile`` also prints a torch.profiler table of each model's step (self CPU time by
op, and its sum: with one thread, a comparison that other jobs on the machine disturb less than wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from zaya.config import ModelConfig
from zaya.core.device import resolve_device, synchronize
from zaya.model import ZayaForCausalLM
from zaya.model.hf import hf_config_from_model_config, hf_state_dict
from zaya.model.info import forward_flops_per_token

try:
    from transformers import ZayaConfig
    from transformers import ZayaForCausalLM as HFZaya
except ImportError as err:  # pragma: no cover - depends on the environment
    sys.exit(f"this benchmark needs transformers with the zaya model ({err})")

FIRST_TOKEN = 3  # ids 0-2 are pad/bos/eos (HF's embedding keeps row pad_token_id = 0 frozen)
PEAK_N = 2048
OPTIM = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """configs/tiny.toml's shape with the issue's overrides (16 experts, 4 layers, D 256)."""
    return ModelConfig(vocab_size=args.vocab, hidden_size=256, num_layers=args.layers, num_query_heads=4,
                       num_kv_heads=2, head_dim=64, num_experts=args.experts, top_k=1, expert_hidden_size=512,
                       router_hidden_size=64, max_seq_len=args.seq, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_hf(cfg: ModelConfig, ours: ZayaForCausalLM, experts: str) -> HFZaya:
    """transformers' model with zaya's config and a copy of zaya's weights."""
    hf_cfg = ZayaConfig(**hf_config_from_model_config(cfg), attn_implementation="sdpa",
                        experts_implementation=experts)
    hf = HFZaya(hf_cfg)
    missing, unexpected = hf.load_state_dict(hf_state_dict(ours), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weight copy into HF failed: missing {missing}, unexpected {unexpected}")
    if hf.lm_head.weight is not hf.model.embed_tokens.weight:
        raise RuntimeError("HF's LM head is not tied to its embedding")
    if hf.config._experts_implementation != experts:
        raise RuntimeError(f"HF experts implementation is {hf.config._experts_implementation!r}, wanted {experts!r}")
    return hf.train()


class Trainer:
    """One model, its AdamW, and the step the benchmark times."""

    def __init__(self, name: str, model: torch.nn.Module, hf: bool, optimizer: str) -> None:
        self.name, self.model, self.hf = name, model, hf
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer_kind = optimizer
        self.opt = torch.optim.AdamW(self.params, **OPTIM, **{optimizer: True})
        self.losses: list[float] = []
        self.tokens_per_expert: torch.Tensor | None = None
        self._snapshot: tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]] | None = None

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.hf:
            return self.model(input_ids=ids, labels=ids).loss
        out = self.model(ids, labels=targets)
        self.tokens_per_expert = out.tokens_per_expert
        return out.loss

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> None:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            loss = self.loss(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))

    @torch.no_grad()
    def snapshot(self) -> None:
        """Remember the weights, buffers and optimizer state (to restore before every later step)."""
        self._snapshot = ({k: v.clone() for k, v in self.model.state_dict().items()},
                          [{k: v.clone() for k, v in self.opt.state[p].items()} for p in self.params])

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the snapshot in place (same storage, as in a real run)."""
        weights, states = self._snapshot
        for k, v in self.model.state_dict().items():
            v.copy_(weights[k])
        for p, saved in zip(self.params, states):
            for k, v in self.opt.state[p].items():
                v.copy_(saved[k])


def fastest_optimizer(model: torch.nn.Module, repeats: int = 9) -> tuple[str, dict[str, float]]:
    """'fused' or 'foreach' AdamW, whichever steps faster over clones of ``model``'s parameters (median ms of
    ``repeats`` steps each, the two kinds alternating)."""
    g = torch.Generator().manual_seed(0)
    opts = {}
    for kind in ("fused", "foreach"):
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.device)
        opts[kind] = torch.optim.AdamW(params, **OPTIM, **{kind: True})
        opts[kind].step()
    times: dict[str, list[float]] = {k: [] for k in opts}
    device = params[0].device
    for _ in range(repeats):
        for kind, opt in opts.items():
            synchronize(device)
            t0 = time.perf_counter()
            opt.step()
            synchronize(device)
            times[kind].append(time.perf_counter() - t0)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return min(med, key=med.get), {k: round(v, 2) for k, v in med.items()}


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine so far (Linux /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle, sum(v[:8])


class OthersMeter:
    """Share of the machine's CPU time that other processes used between ``start`` and ``stop``: the machine's busy
    time minus this process's CPU time, over wall time x CPUs (jiffy resolution, so for intervals >= 0.5 s)."""

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")
        self.cpus = os.cpu_count() or 1

    def start(self) -> None:
        self.busy0, _ = _cpu_jiffies()
        self.own0, self.wall0 = time.process_time(), time.perf_counter()

    def stop(self) -> float:
        busy1, _ = _cpu_jiffies()
        own = time.process_time() - self.own0
        wall = time.perf_counter() - self.wall0
        return max(0.0, (busy1 - self.busy0) / self.hz - own) / max(wall * self.cpus, 1e-9)


def wait_for_quiet(max_busy: float, timeout: float, window: float = 0.5) -> float:
    """Sleep in ``window`` slices until other processes use at most ``max_busy`` of the CPUs during one (or
    ``timeout`` s pass); returns the seconds waited."""
    meter, start = OthersMeter(), time.perf_counter()
    while True:
        meter.start()
        time.sleep(window)
        if meter.stop() <= max_busy or time.perf_counter() - start >= timeout:
            return time.perf_counter() - start


def peak_matmul(device: torch.device, n: int = PEAK_N) -> Callable[[], torch.Tensor]:
    a = torch.randn(n, n).to(device, torch.bfloat16)
    b = torch.randn(n, n).to(device, torch.bfloat16)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    return lambda: torch.mm(a, b, out=out)


def batches(n: int, batch: int, seq: int, vocab: int, seed: int,
            device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids [B, T], zaya's shifted targets [B, T] with -100 at the last position), drawn on the CPU (the same
    batches on every device) and placed on ``device``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(FIRST_TOKEN, vocab, (batch, seq), generator=g)
        targets = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
        out.append((ids.to(device), targets.to(device)))
    return out


@torch.no_grad()
def fp32_losses(ours: ZayaForCausalLM, hf: HFZaya, ids: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    return float(ours(ids, labels=targets).loss), float(hf(input_ids=ids, labels=ids).loss)


def profile_step(trainer: Trainer, data: list, steps: int, rows: int) -> None:
    """Where a model's step spends its time: torch.profiler over ``steps`` steps (each from the snapshot, the restore
    not profiled). Prints self CPU ms per step by op, and by autograd node for the backward (CPU total of each node's
    evaluation: it includes the ops it runs). The profiler adds per-op overhead, so small ops look costlier."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    device = data[0][0].device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ops: dict[str, float] = defaultdict(float)
    nodes: dict[str, float] = defaultdict(float)
    wall = []
    for i in range(steps):
        if trainer._snapshot is not None:
            trainer.restore()
        with profile(activities=activities) as prof:
            synchronize(device)
            t0 = time.perf_counter()
            trainer.step(*data[i % len(data)])
            synchronize(device)
            wall.append(time.perf_counter() - t0)
        for e in prof.key_averages():
            ops[e.key] += e.self_cpu_time_total / 1000 / steps
            if e.key.startswith("autograd::engine::evaluate_function: "):
                nodes[e.key.split(": ", 1)[1]] += e.cpu_time_total / 1000 / steps
    print(f"# profile of {trainer.name}'s step: {1000 * statistics.median(wall):.1f} ms wall per step under the "
          f"profiler (median of {steps}), {sum(ops.values()):.1f} ms self CPU per step; self CPU ms by op:")
    for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"#   {k[:70]:<70} {v:8.1f}")
    print(f"# backward by autograd node (ms per step, {sum(nodes.values()):.1f} in all):")
    for k, v in sorted(nodes.items(), key=lambda kv: -kv[1])[:rows // 2]:
        print(f"#   {k[:70]:<70} {v:8.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of every model before timing")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of every model each)")
    p.add_argument("--hf-experts", default="grouped_mm,eager",
                   help="HF experts implementations to time (hf_tokens_per_s is the fastest)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--free-running", action="store_true",
                   help="let the models train on instead of restoring the state after the first step before every "
                        "step (with random tokens and no balancing, the routing then collapses onto one expert)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--peak-n", type=int, default=PEAK_N,
                   help="size of the square bf16 matmul that measures the peak (smaller for a quick smoke run)")
    p.add_argument("--device", default="auto", help="auto (a GPU when torch sees one, else the CPU), cpu, cuda, cuda:N")
    p.add_argument("--quiet-below", type=float, default=0.1,
                   help="CPU only: before each round, wait until other processes use at most this share of the CPUs "
                        "(sampled over 0.5 s), and time a round again when they used more during it (Linux "
                        "/proc/stat; 1 = neither)")
    p.add_argument("--quiet-timeout", type=float, default=300.0, help="longest wait per round, seconds")
    p.add_argument("--max-redo", type=int, default=5, help="most times one round is timed again")
    p.add_argument("--verbose", action="store_true", help="print every round's step times")
    p.add_argument("--profile", action="store_true", help="also print a torch.profiler table of each model's step")
    p.add_argument("--profile-steps", type=int, default=5)
    args = p.parse_args(argv)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    quiet = args.quiet_below < 1 and device.type == "cpu"  # the quiet-machine wait and re-timing: CPU runs only
    cfg = model_config(args)
    torch.manual_seed(args.seed)
    ours = ZayaForCausalLM(cfg).train()  # built on the CPU (the same weights on every device), then moved
    hf_modes = [m.strip() for m in args.hf_experts.split(",") if m.strip()]
    hfs = {m: build_hf(cfg, ours, m).to(device) for m in hf_modes}
    ours.to(device)
    data = batches(args.warmup + args.steps, args.batch, args.seq, cfg.vocab_size, args.seed + 1, device)
    tokens = args.batch * args.seq

    first_hf = hfs[hf_modes[0]]
    ours_fp32_loss, hf_fp32_loss = fp32_losses(ours, first_hf, *data[0])
    print(f"# fp32 forward on the first batch (weights copied, before any step): zaya loss {ours_fp32_loss:.6f}, "
          f"HF loss {hf_fp32_loss:.6f}, diff {abs(ours_fp32_loss - hf_fp32_loss):.2e}", flush=True)

    ours_opt, ours_opt_ms = fastest_optimizer(ours)
    trainers = {"ours": Trainer("ours", ours, False, ours_opt)}
    opt_ms = {"ours": ours_opt_ms}
    for m, hf in hfs.items():
        kind, ms = fastest_optimizer(hf)
        trainers[f"hf_{m}"] = Trainer(f"hf_{m}", hf, True, kind)
        opt_ms[f"hf_{m}"] = ms
    print(f"# AdamW step alone, median ms: {opt_ms}; using {({k: t.optimizer_kind for k, t in trainers.items()})}",
          flush=True)

    peak = peak_matmul(device, args.peak_n)
    peak()
    reset = not args.free_running
    for i in range(args.warmup):
        for t in trainers.values():
            if reset and i > 0:
                t.restore()
            t.step(*data[i])
            if reset and i == 0:
                t.snapshot()
    times: dict[str, list[float]] = {k: [] for k in [*trainers, "peak"]}
    loads, others, waited, redone = [], [], 0.0, 0
    meter = OthersMeter()
    for r in range(args.steps):
        batch = data[args.warmup + r]
        for attempt in range(args.max_redo + 1):
            if quiet:
                waited += wait_for_quiet(args.quiet_below, args.quiet_timeout)
            meter.start()
            got = {}
            for k, t in trainers.items():
                if reset:
                    t.restore()
                synchronize(device)
                t0 = time.perf_counter()
                t.step(*batch)
                synchronize(device)
                got[k] = time.perf_counter() - t0
            synchronize(device)
            t0 = time.perf_counter()
            peak()
            synchronize(device)
            got["peak"] = time.perf_counter() - t0
            busy = meter.stop()
            if args.verbose:
                print(f"# round {r}: " + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in got.items())
                      + f"; others used {100 * busy:.0f}% of the CPUs meanwhile", flush=True)
            if not quiet or busy <= args.quiet_below or attempt == args.max_redo:
                break
            redone += 1  # another process competed for the cores during this round: time it again
        for k, v in got.items():
            times[k].append(v)
        others.append(busy)
        counts = trainers["ours"].tokens_per_expert[:, : cfg.num_experts].float()
        loads.append(counts.max(1).values / counts.sum(1).clamp_min(1) * cfg.num_experts)
    med = {k: statistics.median(v) for k, v in times.items()}
    peak_flops = 2 * args.peak_n ** 3 / med["peak"]

    flops_per_token = 3 * sum(forward_flops_per_token(cfg, context=args.seq // 2).values())
    ours_tps = tokens / med["ours"]
    hf_tps = {m: tokens / med[f"hf_{m}"] for m in hf_modes}
    best_hf = max(hf_tps, key=hf_tps.get)
    result = {
        "ours_tokens_per_s": round(ours_tps),
        "hf_tokens_per_s": round(hf_tps[best_hf]),
        "speedup": round(ours_tps / hf_tps[best_hf], 2),
        "ours_flops_fraction_of_peak": round(flops_per_token * ours_tps / peak_flops, 3),
        "hf_mode": best_hf,
        "ours_step_ms": round(1000 * med["ours"], 1),
        **{f"hf_{m}_step_ms": round(1000 * med[f"hf_{m}"], 1) for m in hf_modes},
        **{f"hf_{m}_tokens_per_s": round(v) for m, v in hf_tps.items()},
        "ours_first_loss": round(trainers["ours"].losses[0], 5),
        **{f"hf_{m}_first_loss": round(trainers[f"hf_{m}"].losses[0], 5) for m in hf_modes},
        "ours_last_loss": round(trainers["ours"].losses[-1], 5),
        **{f"hf_{m}_last_loss": round(trainers[f"hf_{m}"].losses[-1], 5) for m in hf_modes},
        "max_expert_load": [round(float(x), 2) for x in torch.stack(loads).median(0).values],
        "reset_each_step": reset,
        "fp32_loss_ours": round(ours_fp32_loss, 6),
        "fp32_loss_hf": round(hf_fp32_loss, 6),
        "train_gflop_per_token": round(flops_per_token / 1e9, 4),
        "peak_bf16_tflops": round(peak_flops / 1e12, 3),
        "optimizers": {k: t.optimizer_kind for k, t in trainers.items()},
        "others_cpu_share_max": round(max(others), 3),
        "rounds_redone": redone,
        "quiet_wait_s": round(waited, 1),
        "tokens_per_step": tokens,
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    print(json.dumps(result), flush=True)

    if args.profile:
        for trainer in trainers.values():
            profile_step(trainer, data, args.profile_steps, rows=30)


if __name__ == "__main__":
    main()
