"""GPU check of the planner's activation trace: the fake-tensor trace (CPU autocast policy, no memory) against the
CUDA caching allocator's peak for the same micro-batch on a real GPU.

For each shape: the model in fp32 on the GPU, gradients dropped once accumulated (as in the trace: the planner adds
the gradient buffers per mode), one warm-up step, then ``torch.cuda.reset_peak_memory_stats`` and one forward +
loss + backward under bf16 autocast; measured = ``max_memory_allocated`` minus what was allocated before (weights,
cuBLAS workspace). Printed per shape: measured, traced, their ratio; one JSON line each.

    python benchmarks/planner_gpu_check.py            # tiny, a ZAYA1-width 2-layer model at 4,096 tokens, ...
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

SHAPES = {
    # name: (config, overrides of the model, batch, seq_len, activation checkpointing)
    "tiny-16x128": ("configs/tiny.toml", {}, 16, 128, False),
    "tiny-16x128-ac": ("configs/tiny.toml", {}, 16, 128, True),
    "zaya1-width-2L-1x4096": ("configs/zaya1-base.toml", {"num_layers": 2}, 1, 4096, False),
    "zaya1-width-2L-1x4096-ac": ("configs/zaya1-base.toml", {"num_layers": 2}, 1, 4096, True),
    "zaya1-width-4L-2x4096": ("configs/zaya1-base.toml", {"num_layers": 4}, 2, 4096, False),
}


def measure(cfg, batch: int, seq_len: int, ac: bool) -> int:
    import torch

    from zaya.model import ZayaForCausalLM

    torch.manual_seed(0)
    model = ZayaForCausalLM(cfg).cuda()
    model.activation_checkpointing = ac
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    ids = torch.randint(3, cfg.vocab_size, (batch, seq_len), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, labels=ids)
            loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
            del out
            loss.backward()

    step()  # warm-up: cuBLAS workspaces, kernels
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del model
    torch.cuda.empty_cache()
    return peak


def main() -> int:
    import torch

    from zaya.config import load_config
    from zaya.tune.activation_trace import trace_micro_batch

    if not torch.cuda.is_available():
        print("planner_gpu_check: no GPU", file=sys.stderr)
        return 1
    worst = 0.0
    for name, (path, model_over, batch, seq_len, ac) in SHAPES.items():
        cfg = dataclasses.replace(load_config(ROOT / path).model, **model_over)
        t0 = time.perf_counter()
        measured = measure(cfg, batch, seq_len, ac)
        traced = trace_micro_batch(cfg, batch, seq_len, dtype="bfloat16", activation_checkpointing=ac).peak
        ratio = traced / measured
        worst = max(worst, abs(ratio - 1))
        print(json.dumps({"shape": name, "batch": batch, "seq_len": seq_len, "activation_checkpointing": ac,
                          "measured_bytes": measured, "traced_bytes": traced, "ratio": round(ratio, 4),
                          "seconds": round(time.perf_counter() - t0, 1), "device": torch.cuda.get_device_name(),
                          "torch": torch.__version__}), flush=True)
    print(f"worst |traced / measured - 1| = {worst:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
