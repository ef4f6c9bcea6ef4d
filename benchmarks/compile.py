"""Compiled against eager training step (``train.compile``): the same model, weights, batches and optimizer, one
copy with every block and the loss compiled the way the trainer compiles them
(``zaya.train.compile.CompiledBlocks``), one eager.

One step, for each copy: forward with labels (zaya's cross-entropy: chunked eager, or compiled with the blocks),
backward, ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW.step()`` (fused, as the trainer builds it),
``zero_grad()``; in ``--dtype`` (fp32, or bf16 autocast with fp32 master weights). The learning rate is 1e-5, so
that the routing stays as initialised (spread over the experts) through the run: at a real rate, top-1 routing of
random tokens collapses onto one expert within a few steps, which times a degenerate MoE.

Timing: the compiled copy's first step (it compiles the training graphs: dynamo, AOTAutograd, inductor's code
generation and C++ compile) is timed on its own as ``compile_s``, with the inductor cache in a fresh temporary
directory unless ``--cache-dir`` names one (then a rerun reports the cached compile). Then ``--warmup`` steps of
each, then ``--steps`` rounds, each one eager step and one compiled step back to back (the order alternating
between rounds), so machine noise hits both alike; figures are medians over the rounds, of wall time and of this
process's CPU time (``*_cpu_s``: with ``--threads 1`` the step's compute, which other processes sharing the cores
do not inflate the way they inflate wall time; inductor's compile workers are other processes). Each round waits
first for a quiet machine (``--quiet-below``, benchmarks/quiet.py). Both copies see the same batches; ``max_loss_rel_diff``
is the largest relative difference of their losses over every step (fp32: rounding of fused reductions).

``--profile N``: then N compiled steps under torch's profiler, and a JSON line with where their CPU time went:
inside the compiled regions (forward, backward) and outside them (the rest of the forward and backward: the
embedding, the head's GEMM, gradient accumulation; the clip; the optimizer), the top operators by self time, and
the GEMMs split into the experts' (``aten::_grouped_mm``, one ``aten::mm`` per expert on a CPU, with what it calls)
and the self time of every other ``aten::mm``/``addmm``/``bmm`` (``gemm_shares``).

``--cpp-gemm`` (issue 36): one more compiled copy whose blocks and loss compile with inductor's GEMM autotuning
on and its C++ GEMM templates among the choices (``CPP_GEMM``: ``max_autotune``, ``max_autotune_gemm_backends``
"CPP,ATEN"), timed in the same rounds; ``cpp_gemm_gain`` is the default compiled copy's median CPU time over its,
``cpp_gemm_autotuned`` the number of GEMMs for which inductor had more than aten's kernel to choose from (its
``select_algorithm_autotune`` counter; 0: every GEMM stayed aten's). With ``--backend`` other than inductor (the
smoke test) that copy compiles like the other.

``--gemms`` (issue 36), instead of the steps: each shape's GEMMs alone, one thread's CPU time, medians of
``--steps`` calls: the six products of one MoE layer (forward, input and weight gradients of the SwiGLU up- and
down-projections; the rows spread evenly over the experts) through ``F.grouped_mm`` (one ``aten::mm`` per expert
on a CPU) against one dense GEMM of the same size (what a grouped kernel could reach at best), and the tied head's
product in bf16 against the same product computed in fp32 (operands cast up, the result cast back).

``--cca-taps`` (issue 36): two more copies, eager and compiled, whose CCA layers run their convolutions as
explicit taps (benchmarks/cca_attention.py's ``taps_convolutions``), timed in the same rounds; ``taps_*_gain`` is
the conv2d copy's median CPU time over the taps copy's (eager against eager, compiled against compiled).

Shapes: ``tiny`` is configs/tiny.toml's model (d=256, 4 layers, 8 experts, 16 x 128 tokens); ``wide`` doubles
its width and expert width (d=512, expert 1024, 8 query heads, 8 x 256 tokens).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/compile.py [--shapes tiny,wide] [--dtypes fp32,bf16]
[--steps N] [--warmup N] [--threads N] [--backend inductor] [--cache-dir DIR] [--cpp-gemm] [--cca-taps]
[--gemms]``. Prints one JSON line per (shape, dtype) and a final line with the speed-ups (``--gemms``: one line per
shape).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quiet import wait_quiet  # noqa: E402

from zaya.config import ModelConfig  # noqa: E402
from zaya.core.hardware import cpu_model_name  # noqa: E402
from zaya.model import ZayaForCausalLM  # noqa: E402
from zaya.model.attention import Attention  # noqa: E402
from zaya.core.compile import CACHE_ENV  # noqa: E402
from zaya.train import compile as compile_module  # noqa: E402

TINY = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_query_heads=4, num_kv_heads=2, head_dim=64,
            num_experts=8, top_k=1, expert_hidden_size=512, router_hidden_size=64, max_seq_len=256)
SHAPES = {
    "tiny": (TINY, 16, 128),
    "wide": ({**TINY, "hidden_size": 512, "num_query_heads": 8, "expert_hidden_size": 1024}, 8, 256),
    # The smoke test's: seconds to compile through aot_eager, not a figure to report.
    "micro": ({**TINY, "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_query_heads": 2,
               "num_kv_heads": 1, "head_dim": 32, "num_experts": 4, "expert_hidden_size": 64,
               "router_hidden_size": 16}, 2, 32),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
TARGET = 1.3
"""Issue 36's target: a compiled step at least 1.3x the eager step on the tiny shape."""
CPP_GEMM = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
"""Inductor's options for ``--cpp-gemm``: autotune each GEMM among aten's kernel and inductor's C++ templates."""


def cpp_gemm_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Inductor with ``CPP_GEMM`` (a ``torch.compile`` backend)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=CPP_GEMM)


class Copy:
    """One copy of the model with its optimizer; ``step`` is one training step, returning its loss."""

    def __init__(self, model: ZayaForCausalLM, dtype: str) -> None:
        self.model, self.dtype = model, dtype
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        with record_function("forward"), torch.autocast("cpu", dtype=torch.bfloat16,
                                                        enabled=self.dtype == "bfloat16"):
            loss = self.model(ids, labels=labels).loss
        with record_function("backward"):
            loss.backward()
        with record_function("clip"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        with record_function("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def timed(copy_: Copy, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds, loss) of one step."""
    start, cpu = time.perf_counter(), time.process_time()
    loss = copy_.step(ids, labels)
    return time.perf_counter() - start, time.process_time() - cpu, loss


def measure(shape: str, dtype: str, args: argparse.Namespace) -> dict:
    fields, batch, seq = SHAPES[shape]
    torch.manual_seed(0)
    eager_model = ZayaForCausalLM(ModelConfig(**fields))
    models = {"eager": eager_model, "compiled": copy.deepcopy(eager_model)}
    if args.cpp_gemm:
        models["cpp_gemm_compiled"] = copy.deepcopy(eager_model)
    if args.cca_taps:
        models["taps_eager"], models["taps_compiled"] = copy.deepcopy(eager_model), copy.deepcopy(eager_model)
        for name in ("taps_eager", "taps_compiled"):
            use_cca_taps(models[name])
    torch._dynamo.reset()
    copies = {}
    for name, model in models.items():
        if name.endswith("compiled"):
            tuned = name == "cpp_gemm_compiled" and args.backend == "inductor"
            compile_module.BACKEND = cpp_gemm_backend if tuned else args.backend
            compile_module.CompiledBlocks(model, log=lambda m: print(m, file=sys.stderr))
        copies[name] = Copy(model, DTYPES[dtype])
    eager, compiled = copies["eager"], copies["compiled"]
    generator = torch.Generator().manual_seed(1)

    def batch_of_tokens():
        ids = torch.randint(3, fields["vocab_size"], (batch, seq + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]

    ids, labels = batch_of_tokens()
    autotuned = torch._dynamo.utils.counters["inductor"]["select_algorithm_autotune"]
    first = {name: timed(c, ids, labels) for name, c in copies.items()}  # compiles the compiled copies
    compile_s = {name: first[name][0] for name in copies if name.endswith("compiled")}
    autotuned = torch._dynamo.utils.counters["inductor"]["select_algorithm_autotune"] - autotuned
    eager_loss = first["eager"][2]
    diffs = [max(abs(r[2] - eager_loss) / abs(eager_loss) for r in first.values())]
    for _ in range(args.warmup):
        ids, labels = batch_of_tokens()
        losses = {name: timed(c, ids, labels)[2] for name, c in copies.items()}
        diffs.append(max(abs(v - losses["eager"]) / abs(losses["eager"]) for v in losses.values()))
    times: dict[str, list[float]] = {name: [] for name in copies}
    cpu: dict[str, list[float]] = {name: [] for name in copies}
    for i in range(args.steps):
        ids, labels = batch_of_tokens()
        wait_quiet(args.quiet_below, timeout=30.0)
        order = list(copies.items())
        losses = {}
        for name, c in order if i % 2 == 0 else order[::-1]:
            seconds, cpu_seconds, losses[name] = timed(c, ids, labels)
            times[name].append(seconds)
            cpu[name].append(cpu_seconds)
        diffs.append(max(abs(v - losses["eager"]) / abs(losses["eager"]) for v in losses.values()))
    shares = profile_shares(compiled, [batch_of_tokens() for _ in range(args.profile)]) if args.profile else {}
    eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
    eager_cpu, compiled_cpu = statistics.median(cpu["eager"]), statistics.median(cpu["compiled"])
    extra = {}
    if args.cpp_gemm:
        med = statistics.median(cpu["cpp_gemm_compiled"])
        extra = {"cpp_gemm_compile_s": round(compile_s["cpp_gemm_compiled"] - eager_s, 2),
                "cpp_gemm_cpu_s": round(med, 4), "cpp_gemm_gain": round(compiled_cpu / med, 3),
                "cpp_gemm_cpu_speedup": round(eager_cpu / med, 3), "cpp_gemm_autotuned": autotuned,
                "cpp_gemm_times_s": [round(t, 4) for t in times["cpp_gemm_compiled"]]}
    if args.cca_taps:
        med = {name: statistics.median(cpu[name]) for name in ("taps_eager", "taps_compiled")}
        extra |= {"taps_compile_s": round(compile_s["taps_compiled"] - statistics.median(times["taps_eager"]), 2),
                 "taps_eager_cpu_s": round(med["taps_eager"], 4), "taps_compiled_cpu_s": round(med["taps_compiled"], 4),
                 "taps_eager_gain": round(eager_cpu / med["taps_eager"], 3),
                 "taps_compiled_gain": round(compiled_cpu / med["taps_compiled"], 3),
                 "taps_eager_times_s": [round(t, 4) for t in times["taps_eager"]],
                 "taps_compiled_times_s": [round(t, 4) for t in times["taps_compiled"]]}
    return {"shape": shape, "dtype": dtype, "backend": args.backend, "tokens": batch * seq,
            "compile_s": round(compile_s["compiled"] - eager_s, 2),
            "eager_step_s": round(eager_s, 4), "compiled_step_s": round(compiled_s, 4),
            "speedup": round(eager_s / compiled_s, 3), "eager_cpu_s": round(eager_cpu, 4),
            "compiled_cpu_s": round(compiled_cpu, 4), "cpu_speedup": round(eager_cpu / compiled_cpu, 3),
            "eager_times_s": [round(t, 4) for t in times["eager"]],
            "compiled_times_s": [round(t, 4) for t in times["compiled"]],
            "max_loss_rel_diff": float(f"{max(diffs):.2e}"), "steps": args.steps, **extra, **shares}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU milliseconds of ``fn()`` over ``repeats`` calls, after two unmeasured ones."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        samples.append(time.process_time() - start)
    return round(statistics.median(samples) * 1e3, 2)


def gemms(shape: str, repeats: int) -> dict:
    """``--gemms``: one MoE layer's six expert products, grouped against dense, and the head's bf16 product
    against it computed in fp32 (milliseconds)."""
    fields, batch, seq = SHAPES[shape]
    experts, d, width = fields["num_experts"], fields["hidden_size"], fields["expert_hidden_size"]
    rows = batch * seq * fields["top_k"]
    torch.manual_seed(0)
    offsets = torch.full((experts,), rows // experts).cumsum(0).to(torch.int32)
    x, h = torch.randn(rows, d), torch.randn(rows, width)
    up, down = torch.randn(experts, 2 * width, d), torch.randn(experts, d, width)
    grad_up, grad_down = torch.randn(rows, 2 * width), torch.randn(rows, d)
    products = {  # name: (grouped, dense): the dense GEMM has the same sizes, expert 0's weight for every row
        "up forward": (lambda: F.grouped_mm(x, up.transpose(-2, -1), offs=offsets), lambda: x @ up[0].T),
        "down forward": (lambda: F.grouped_mm(h, down.transpose(-2, -1), offs=offsets), lambda: h @ down[0].T),
        "up input grad": (lambda: F.grouped_mm(grad_up, up, offs=offsets), lambda: grad_up @ up[0]),
        "down input grad": (lambda: F.grouped_mm(grad_down, down, offs=offsets), lambda: grad_down @ down[0]),
        "up weight grad": (lambda: F.grouped_mm(grad_up.t(), x, offs=offsets), lambda: grad_up.t() @ x),
        "down weight grad": (lambda: F.grouped_mm(grad_down.t(), h, offs=offsets), lambda: grad_down.t() @ h),
    }
    experts_ms = {name: [median_ms(g, repeats), median_ms(dense, repeats)] for name, (g, dense) in products.items()}
    a = torch.randn(rows, d, dtype=torch.bfloat16)
    head = torch.randn(fields["vocab_size"], d, dtype=torch.bfloat16)
    return {"shape": shape, "gemms": True, "experts_grouped_dense_ms": experts_ms,
            "experts_layer_ms": [round(sum(v[0] for v in experts_ms.values()), 1),
                                 round(sum(v[1] for v in experts_ms.values()), 1)],
            "head_bf16_ms": median_ms(lambda: a @ head.T, repeats),
            "head_bf16_in_fp32_ms": median_ms(lambda: (a.float() @ head.float().T).bfloat16(), repeats)}


def use_cca_taps(model: ZayaForCausalLM) -> None:
    """Every CCA layer of ``model`` runs its convolutions through benchmarks/cca_attention.py's
    ``taps_convolutions`` (issue 36's candidate) instead of the model's conv2d path."""
    from cca_attention import taps_convolutions

    for module in model.modules():
        if isinstance(module, Attention) and module.kind == "cca":
            module._convolutions = functools.partial(taps_convolutions, module)


def profile_shares(copy_: Copy, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Shares of the compiled copy's CPU time over ``batches`` (one step each): in its compiled regions (dynamo's
    "Torch-Compiled Region" forward, AOTAutograd's "CompiledFunctionBackward"), the rest of each phase, and the
    top operators by self time."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids, labels in batches:
            copy_.step(ids, labels)
    events = prof.key_averages()
    total = {e.key: e.cpu_time_total for e in events}
    compiled_fwd = sum(v for k, v in total.items() if k.startswith("Torch-Compiled Region"))
    compiled_bwd = total.get("CompiledFunctionBackward", 0.0)
    parts = {"compiled forward": compiled_fwd, "eager forward": total["forward"] - compiled_fwd,
             "compiled backward": compiled_bwd, "eager backward": total["backward"] - compiled_bwd,
             "clip": total["clip"], "optimizer": total["optimizer"]}
    step = sum(parts.values())
    self_time: dict[str, float] = {}
    for e in events:  # inductor's generated code runs as "## Call CompiledFxGraph <hash> ##"
        key = "inductor's kernels" if e.key.startswith("## Call CompiledFxGraph") else e.key
        self_time[key] = self_time.get(key, 0.0) + e.self_cpu_time_total
    top = sorted(self_time.items(), key=lambda kv: -kv[1])[:8]
    return {"profile_steps": len(batches), "step_cpu_s": round(step / 1e6 / len(batches), 4),
            "shares": {k: round(v / step, 3) for k, v in parts.items()},
            "top_self": {k: round(v / step, 3) for k, v in top},
            "gemm_shares": {"experts' grouped_mm": round(total.get("aten::_grouped_mm", 0.0) / step, 3),
                            "other GEMMs": round(gemms_outside(prof.events(), "aten::_grouped_mm") / step, 3)}}


def gemms_outside(events: list, op: str) -> float:
    """Self CPU time (us) of the ``aten::mm``/``addmm``/``bmm`` calls in a profile's ``events`` that ``op`` did not
    make (no caller of theirs, however far up, is ``op``)."""
    micros = 0.0
    for event in events:
        if event.name in ("aten::mm", "aten::addmm", "aten::bmm"):
            caller = event.cpu_parent
            while caller is not None and caller.name != op:
                caller = caller.cpu_parent
            micros += event.self_cpu_time_total if caller is None else 0.0
    return micros


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,wide", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="fp32", help="comma-separated, of fp32, bf16")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: a smoke test)")
    parser.add_argument("--cpp-gemm", action="store_true",
                        help="also time a compiled copy with inductor's GEMM autotuning and C++ GEMM templates")
    parser.add_argument("--gemms", action="store_true",
                        help="instead: the experts' GEMMs grouped against dense, the head's bf16 GEMM against fp32")
    parser.add_argument("--cca-taps", action="store_true",
                        help="also time an eager and a compiled copy with the CCA convolutions as explicit taps")
    parser.add_argument("--profile", type=int, default=0, help="then profile this many compiled steps")
    parser.add_argument("--cache-dir", default="", help="inductor cache directory (default: a fresh temporary one)")
    parser.add_argument("--quiet-below", type=float, default=0.1,
                        help="before each round, wait up to 30 s until other processes use at most this CPU share")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ[CACHE_ENV] = args.cache_dir or tempfile.mkdtemp(prefix="zaya-inductor-")
    print(json.dumps({"machine": cpu_model_name(), "threads": args.threads, "torch": torch.__version__,
                      "inductor_cache": os.environ[CACHE_ENV]}), flush=True)
    if args.gemms:
        for shape in args.shapes.split(","):
            print(json.dumps(gemms(shape, args.steps)), flush=True)
        return
    speedups = {}
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            row = measure(shape, dtype, args)
            speedups[f"{shape}/{dtype}"] = row["speedup"]
            print(json.dumps(row), flush=True)
    tiny = [v for k, v in speedups.items() if k.startswith("tiny/")]
    print(json.dumps({"final": True, "speedups": speedups, "target": TARGET,
                      "target_met": bool(tiny) and min(tiny) >= TARGET}))


if __name__ == "__main__":
    main()
