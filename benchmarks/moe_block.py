"""Forward + backward of zaya's MoE block (router included) against ``transformers``' ``ZayaSparseMoeBlock``.

Both blocks get the same (perturbed random) weights: ours are built, perturbed so that routing is non-trivial, and
copied into Hugging Face's under the checkpoint name mapping (``zaya.model.hf._RENAMES``). Layer index 1, so EDA is
active, and both get the same random previous router latent. Before timing, the script checks that the two blocks
agree: in fp32 (tight tolerance: same routing, same outputs and gradients up to fp32 rounding) and in each timed bf16
mode (loose tolerance: a few tokens may flip expert where two router probabilities are within bf16 rounding).

Timed modes (one "iteration" = zero grads, forward, backward of a fixed random upstream gradient on both outputs,
so every parameter gradient and the input gradients are computed):

- ``ours_ms``: zaya with bf16 weights and bf16 inputs. This is the headline mode: the published recipe keeps bf16
  weights, and it is also Hugging Face's faster mode.
- ``ours_autocast_ms``: zaya with fp32 weights under bf16 autocast on the benchmark's device (what the trainer
  runs with ``train.dtype = "bfloat16"``).
- ``hf_autocast_ms`` / ``hf_bf16_ms``: ``ZayaSparseMoeBlock`` as a standalone module (its default ``eager`` experts
  path: a Python loop over experts), fp32 weights under autocast / bf16 weights.
- ``hf_gmm_autocast_ms`` / ``hf_gmm_bf16_ms`` (extra): the same block with ``experts_implementation =
  "grouped_mm"``, the path ``transformers`` picks by default when it builds a whole model (``from_pretrained``).

``speedup`` = min(hf_autocast_ms, hf_bf16_ms) / ours_ms (standalone-block defaults, as the issue asks);
``speedup_vs_hf_gmm`` does the same against the grouped_mm modes. ``fraction_of_peak`` = expert-matmul FLOPs of
forward + backward (3 x 2 * tokens * k * (D * 2I + I * D)) / ours_ms, over this machine's bf16 matmul peak measured
in the same run (a 4096^3 bf16 matmul timed as one more mode in every round). Modes are timed round-robin (each
repeat runs every mode once) so that machine noise hits all of them alike; the numbers are medians over
``--repeats``, after one warm-up round.

Device: ``--device`` (default ``auto``: the GPU when torch sees one, else the CPU; ``zaya.core.device.resolve_device``).
Everything (both blocks, the inputs, the peak matmul) lives there and autocast runs on that device's type. On a GPU
the device is synchronised before each timer is read (kernels run asynchronously); on the CPU each round first
waits, up to ``--quiet-timeout`` s, until the machine is at most ``--quiet-below`` busy (``benchmarks/quiet.py``:
the VMs these run on are shared), which a GPU run skips.

Run: ``PYTHONPATH=src python benchmarks/moe_block.py [--shapes tiny,base] [--repeats N] [--tokens N] [--device D]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from quiet import wait_quiet  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from zaya.config import ModelConfig
from zaya.core.device import resolve_device, synchronize
from zaya.model.hf import _RENAMES
from zaya.model.moe import MoEBlock

try:
    from transformers.models.zaya.configuration_zaya import ZayaConfig
    from transformers.models.zaya.modeling_zaya import ZayaSparseMoeBlock
except ImportError as err:  # pragma: no cover - depends on the environment
    sys.exit(f"this benchmark needs transformers with the zaya model ({err})")

SHAPES = {
    # configs/tiny.toml
    "tiny": dict(hidden_size=256, num_experts=8, top_k=1, expert_hidden_size=512, router_hidden_size=64),
    # one ZAYA1-base layer (configs/zaya1-base.toml)
    "base": dict(hidden_size=2048, num_experts=16, top_k=1, expert_hidden_size=2048, router_hidden_size=256),
}
LAYER_INDEX = 1  # > 0: EDA active
CHECK_TOKENS = 1024  # tokens used for the agreement checks (routing is per token, so a subset is as good as all)
CHECK_MARGIN = 0.02  # their top-1 router class leads the next by this much (bf16 rounding is ~0.4% relative)


def hf_name(ours: str) -> str | None:
    """HF name inside the MoE block for a tensor name inside ours (``router.fc1.weight`` -> ``gate.router_mlp...``)."""
    for z, h in _RENAMES:
        if z.startswith("moe.") and z[len("moe."):] == ours:
            return h[len("mlp."):]
    return None


@torch.no_grad()
def router_probs(ours: MoEBlock, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """fp32 router probabilities [tokens, classes] (the router's own steps, EDA on, without the choice)."""
    router = ours.router
    latent = router.down_proj(h) + prev * router.eda_scale
    z = torch.nn.functional.gelu(router.fc1(router.norm(latent)))
    probs = torch.softmax(router.out_proj(torch.nn.functional.gelu(router.fc2(z))).float(), dim=-1)
    return probs.reshape(-1, probs.shape[-1])


@torch.no_grad()
def balance(ours: MoEBlock, h: torch.Tensor, prev: torch.Tensor, steps: int = 2000) -> None:
    """Set the experts' balancing biases so that these tokens spread about evenly over the experts.

    A trained ZAYA1 router is kept near balance by exactly these biases; an unbalanced toy router would instead
    time a few overloaded experts. The skip class keeps its released-checkpoint bias (-1).
    """
    router = ours.router
    probs = router_probs(ours, h, prev)
    e = router.num_experts
    for step in range(steps):
        chosen = torch.topk(probs + router.balancing_biases, router.top_k, dim=-1).indices
        f = torch.bincount(chosen.reshape(-1), minlength=router.num_classes)[:e].float() / chosen.numel()
        lr = 0.5 * 0.01 ** (step / steps)  # decaying step: settles instead of oscillating
        router.balancing_biases[:e] -= lr * (f - 1.0 / e)


def build(shape: str, seed: int, inputs: dict[str, torch.Tensor],
          device: torch.device) -> tuple[MoEBlock, ZayaSparseMoeBlock, ModelConfig]:
    """Both blocks with the same weights, on ``device`` (built on the CPU, so the weights do not depend on it)."""
    s = SHAPES[shape]
    cfg = ModelConfig(vocab_size=256, num_layers=2, max_seq_len=4096, **s)
    torch.manual_seed(seed)
    ours = MoEBlock(cfg, LAYER_INDEX)
    ours.reset_parameters(cfg.init_std, cfg.num_layers)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        router = ours.router
        # A router whose logits spread over O(1), so the top-1 choice is clear-cut and the tokens are spread over
        # all experts; every bias, scale and norm weight moved off its init.
        for lin in (router.fc1, router.fc2, router.out_proj):
            lin.weight.normal_(0.0, 2.0 / lin.in_features ** 0.5, generator=g)
        for lin in (router.down_proj, router.fc1, router.fc2):
            lin.bias.normal_(0.0, 0.1, generator=g)
        router.norm.weight.copy_(1.0 + 0.2 * torch.randn(cfg.router_hidden_size, generator=g))
        router.eda_scale.copy_(1.0 + 0.2 * torch.randn(cfg.router_hidden_size, generator=g))
        router.balancing_biases[: cfg.num_experts] = 0.02 * torch.randn(cfg.num_experts, generator=g)
        ours.experts.gate_up_proj.normal_(0.0, cfg.hidden_size ** -0.5, generator=g)
        ours.experts.down_proj.normal_(0.0, cfg.expert_hidden_size ** -0.5, generator=g)
    balance(ours, inputs["h"].cpu(), inputs["prev"].cpu())

    hf_cfg = ZayaConfig(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                        moe_intermediate_size=cfg.expert_hidden_size, router_hidden_size=cfg.router_hidden_size,
                        rms_norm_eps=cfg.norm_eps, hidden_act="silu", num_hidden_layers=2)
    hf_cfg._experts_implementation = "eager"  # what a standalone ZayaSparseMoeBlock runs
    hf = ZayaSparseMoeBlock(hf_cfg, LAYER_INDEX)
    hf_state = hf.state_dict()
    copied = set()
    for name, tensor in ours.state_dict().items():
        target = hf_name(name)
        if target is None:
            continue  # zaya-only balancing moments
        hf_state[target].copy_(tensor)
        copied.add(target)
    missing = set(hf_state) - copied
    if missing:
        raise RuntimeError(f"HF tensors not set from ours: {sorted(missing)}")
    return ours.to(device), hf.to(device), cfg


def bf16_copy(module: torch.nn.Module) -> torch.nn.Module:
    """bf16 weights; the balancing biases stay fp32 buffers as in the released checkpoints."""
    out = copy.deepcopy(module)
    for p in out.parameters():
        p.data = p.data.to(torch.bfloat16)
    return out


def make_inputs(shape: str, tokens: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random block inputs and upstream gradients (drawn on the CPU, the same on every device), on ``device``."""
    s = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    b = 2 if tokens % 2 == 0 else 1
    t = tokens // b
    inputs = dict(
        h=torch.randn(b, t, s["hidden_size"], generator=g),
        prev=torch.randn(b, t, s["router_hidden_size"], generator=g),
        grad_out=torch.randn(b, t, s["hidden_size"], generator=g),
        grad_latent=torch.randn(b, t, s["router_hidden_size"], generator=g),
    )
    return {k: v.to(device) for k, v in inputs.items()}


def leaves(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The block inputs in ``dtype`` as leaf tensors that want gradients (made once per dtype and reused)."""
    key = f"leaves_{dtype}"
    if key not in inputs:
        inputs[key] = tuple(inputs[n].detach().to(dtype, copy=True).requires_grad_(True) for n in ("h", "prev"))
    return inputs[key]


def run_once(kind: str, module: torch.nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype,
             autocast: bool, want: bool = False):
    """Zero grads, forward, backward. Returns (out, latent, {name: grad}) when ``want``."""
    for p in module.parameters():
        p.grad = None
    h, prev = leaves(inputs, dtype)
    h.grad = prev.grad = None
    ctx = torch.autocast(h.device.type, dtype=torch.bfloat16) if autocast else nullcontext()
    with ctx:
        if kind == "ours":
            out, latent, _, _ = module(h, prev)
        else:
            out, latent = module(h, prev)
    torch.autograd.backward([out, latent], [inputs["grad_out"].to(out.dtype),
                                            inputs["grad_latent"].to(latent.dtype)])
    if not want:
        return None
    grads = {"h": h.grad, "prev": prev.grad}
    for name, p in module.named_parameters():
        grads[name] = p.grad
    return out.detach(), latent.detach(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(ours: torch.nn.Module, hf: torch.nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype,
            autocast: bool) -> dict[str, float]:
    """Relative errors of ours against HF: output, latent, worst parameter/input gradient; routing agreement."""
    o_out, o_lat, o_g = run_once("ours", ours, inputs, dtype, autocast, want=True)
    h_out, h_lat, h_g = run_once("hf", hf, inputs, dtype, autocast, want=True)
    worst, worst_name = 0.0, ""
    for name, g in o_g.items():
        other = h_g[name] if name in ("h", "prev") else h_g[hf_name(name)]
        e = rel_err(g, other)
        if e > worst:
            worst, worst_name = e, name
    with torch.no_grad():
        ctx = torch.autocast(inputs["h"].device.type, dtype=torch.bfloat16) if autocast else nullcontext()
        with ctx:
            r = ours.router(inputs["h"].to(dtype), inputs["prev"].to(dtype))
            _, _, hf_idx, _ = hf.gate(inputs["h"].to(dtype), inputs["prev"].to(dtype))
        ours_idx = r.experts.reshape(hf_idx.shape)
        ours_idx = ours_idx.masked_fill(ours_idx == ours.experts.num_experts, 0)  # HF reports skip as expert 0
        same = float((ours_idx == hf_idx).float().mean())
    return dict(out=rel_err(o_out, h_out), latent=rel_err(o_lat, h_lat), grad=worst, grad_name=worst_name,
                same_routing=same)


PEAK_N = 4096


def peak_matmul(device: torch.device, n: int = PEAK_N) -> Callable[[], torch.Tensor]:
    """An n^3 bf16 matmul (2 * n^3 FLOPs), the yardstick for this machine's bf16 matmul peak."""
    a = torch.randn(n, n).to(device, torch.bfloat16)
    b = torch.randn(n, n).to(device, torch.bfloat16)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    return lambda: torch.mm(a, b, out=out)


def timed(fn: Callable, device: torch.device) -> float:
    """Seconds that ``fn()`` takes, its device work included (synchronised before and after on a GPU)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def measure_peak(device: torch.device, n: int = PEAK_N, repeats: int = 5) -> float:
    """Median bf16 matmul throughput (FLOP/s) of n^3 matmuls."""
    mm = peak_matmul(device, n)
    mm()
    times = [timed(mm, device) for _ in range(repeats)]
    return 2 * n ** 3 / statistics.median(times)


def bench_shape(shape: str, tokens: int, repeats: int, device: torch.device, quiet_below: float = 1.0,
                quiet_timeout: float = 0.0, peak_n: int = PEAK_N) -> dict:
    inputs = make_inputs(shape, tokens, seed=1, device=device)
    ours32, hf32, cfg = build(shape, 0, inputs, device)
    ours16, hf16 = bf16_copy(ours32), bf16_copy(hf32)
    # Check tokens: ones whose choice is clear-cut (top-1 ahead of the next class by >= CHECK_MARGIN in biased
    # probability), so that bf16 rounding cannot flip it and a flip would mean a real disagreement.
    biased = router_probs(ours32, inputs["h"], inputs["prev"]) + ours32.router.balancing_biases
    top2 = biased.topk(2, dim=-1).values
    clear = ((top2[:, 0] - top2[:, 1]) >= CHECK_MARGIN).nonzero().squeeze(1)[:CHECK_TOKENS]
    check_inputs = {k: v.reshape(-1, v.shape[-1])[clear][None] for k, v in inputs.items()}

    # Agreement checks before timing.
    checks = {
        "fp32": compare(ours32, hf32, check_inputs, torch.float32, autocast=False),
        "autocast": compare(ours32, hf32, check_inputs, torch.float32, autocast=True),
        "bf16": compare(ours16, hf16, check_inputs, torch.bfloat16, autocast=False),
    }
    # (output/latent rel. error, worst gradient rel. error, fraction of tokens routed alike). Under bf16 the two
    # routers differ in where they round (ours: fp32 softmax; HF: softmax in the logits' dtype), which moves the
    # router gradients by ~1e-2; the expert path itself matches to rounding.
    limits = {"fp32": (1e-5, 1e-4, 1.0), "autocast": (2e-2, 5e-2, 1.0), "bf16": (2e-2, 5e-2, 1.0)}
    ok = True
    for mode, c in checks.items():
        tol_out, tol_grad, min_same = limits[mode]
        good = c["out"] < tol_out and c["latent"] < tol_out and c["grad"] < tol_grad and c["same_routing"] >= min_same
        ok &= good
        print(f"# check {shape} {mode} ({check_inputs['h'].shape[1]} tokens): rel err out {c['out']:.2e}, "
              f"latent {c['latent']:.2e}, worst grad {c['grad']:.2e} ({c['grad_name']}); same expert for "
              f"{100 * c['same_routing']:.2f}% of tokens -> {'ok' if good else 'MISMATCH'}", flush=True)
    if not ok:
        raise SystemExit(f"ours and transformers disagree at shape {shape}; not timing")

    with torch.no_grad():
        r = ours16.router(inputs["h"].to(torch.bfloat16), inputs["prev"].to(torch.bfloat16))
        skip_fraction = float((r.experts == cfg.num_experts).float().mean())
        load = torch.bincount(r.experts.reshape(-1), minlength=cfg.num_experts + 1)[: cfg.num_experts].float()
        max_load = float(load.max() / load.mean())

    def set_hf_impl(impl: str) -> None:
        hf32.experts.config._experts_implementation = impl
        hf16.experts.config._experts_implementation = impl

    modes = {
        "peak": peak_matmul(device, peak_n),
        "ours": lambda: run_once("ours", ours16, inputs, torch.bfloat16, False),
        "ours_autocast": lambda: run_once("ours", ours32, inputs, torch.float32, True),
        "hf_autocast": lambda: (set_hf_impl("eager"), run_once("hf", hf32, inputs, torch.float32, True)),
        "hf_bf16": lambda: (set_hf_impl("eager"), run_once("hf", hf16, inputs, torch.bfloat16, False)),
        "hf_gmm_autocast": lambda: (set_hf_impl("grouped_mm"), run_once("hf", hf32, inputs, torch.float32, True)),
        "hf_gmm_bf16": lambda: (set_hf_impl("grouped_mm"), run_once("hf", hf16, inputs, torch.bfloat16, False)),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for m, fn in modes.items():  # warm-up
        fn()
    synchronize(device)
    not_quiet = 0
    for _ in range(repeats):
        if device.type == "cpu" and quiet_below < 1:
            not_quiet += not wait_quiet(quiet_below, quiet_timeout)
        for m, fn in modes.items():
            times[m].append(timed(fn, device))
    med = {m: 1000 * statistics.median(v) for m, v in times.items()}
    peak = 2 * peak_n ** 3 / (med["peak"] / 1000)

    d, i, k = cfg.hidden_size, cfg.expert_hidden_size, cfg.top_k
    flops = 3 * 2 * tokens * k * (d * 2 * i + i * d)
    return {
        "shape": shape,
        "tokens": tokens,
        "ours_ms": round(med["ours"], 1),
        "hf_autocast_ms": round(med["hf_autocast"], 1),
        "hf_bf16_ms": round(med["hf_bf16"], 1),
        "speedup": round(min(med["hf_autocast"], med["hf_bf16"]) / med["ours"], 2),
        "fraction_of_peak": round(flops / (med["ours"] / 1000) / peak, 3),
        "ours_autocast_ms": round(med["ours_autocast"], 1),
        "hf_gmm_autocast_ms": round(med["hf_gmm_autocast"], 1),
        "hf_gmm_bf16_ms": round(med["hf_gmm_bf16"], 1),
        "speedup_vs_hf_gmm": round(min(med["hf_gmm_autocast"], med["hf_gmm_bf16"]) / med["ours"], 2),
        "expert_tflop": round(flops / 1e12, 4),
        "peak_bf16_tflops": round(peak / 1e12, 3),
        "skip_fraction": round(skip_fraction, 4),
        "max_expert_load": round(max_load, 3),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "device": str(device),
        **({"rounds_not_quiet": not_quiet} if device.type == "cpu" and quiet_below < 1 else {}),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="tiny,base", help="comma-separated subset of: " + ", ".join(SHAPES))
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per mode (after one warm-up)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per forward (split over a batch of 2)")
    p.add_argument("--peak-n", type=int, default=PEAK_N,
                   help="size of the square bf16 matmul that measures the peak (smaller for a quick smoke run)")
    p.add_argument("--device", default="auto", help="auto (a GPU when torch sees one, else the CPU), cpu, cuda, cuda:N")
    p.add_argument("--quiet-below", type=float, default=0.15,
                   help="CPU only: before each round, wait until the machine is at most this busy (0.5 s samples of "
                        "/proc/stat; 1 = do not wait)")
    p.add_argument("--quiet-timeout", type=float, default=10.0, help="CPU only: longest wait per round, seconds")
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    if args.repeats < 1 or args.tokens < 1:
        p.error("--repeats and --tokens must be positive")
    device = resolve_device(args.device)
    peak = measure_peak(device, args.peak_n)
    print(f"# bf16 matmul peak at start (median of 5 x {args.peak_n}^3) on {device}: {peak / 1e12:.3f} TFLOP/s, "
          f"{torch.get_num_threads()} threads; fraction_of_peak uses the same matmul timed in every round", flush=True)
    for s in shapes:
        print(json.dumps(bench_shape(s, args.tokens, args.repeats, device, args.quiet_below, args.quiet_timeout,
                                     args.peak_n)), flush=True)


if __name__ == "__main__":
    main()
