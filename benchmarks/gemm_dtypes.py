"""Which dtype and layout every GEMM of one bf16-autocast training step sees, in zaya's model and in transformers'.

One forward + backward of the ``benchmarks/train_step.py`` models (zaya's ``ZayaForCausalLM`` and transformers'
``ZayaForCausalLM`` loaded from the same weights, HF with its ``grouped_mm`` and ``eager`` experts) under
``torch.autocast(device, torch.bfloat16)``. A ``TorchDispatchMode`` (``GemmLog``) sees every aten operator below
autocast, so with the dtypes autocast chose; it records each matrix product (``mm``, ``addmm``, ``bmm``,
``_grouped_mm``, the convolutions, SDPA's fused kernels and their backwards): the phase (forward or backward, from
autograd's current graph task), the input dtypes, the FLOPs and each operand's layout (``row``: contiguous, ``col``:
a transposed contiguous matrix, which BLAS takes as it is; ``strided``: neither, which forces a copy).

Prints, per model, one line per (phase, op, dtypes, layouts) class: calls and GFLOP; then one JSON line per model
with the GFLOP by phase and dtype. Machine-independent (dtypes and layouts do not depend on the CPU), so it explains
an AMX machine's profile on any CPU.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/gemm_dtypes.py [--batch 2 --seq 256]``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# op -> (index of the left operand, index of the right operand); FLOPs = 2 * left.numel() * right.shape[-1].
PRODUCTS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
            aten.baddbmm.default: (1, 2), aten._grouped_mm.default: (0, 1)}
CONVOLUTIONS = {aten.convolution.default, aten.convolution_backward.default}
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_efficient_attention_backward.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_flash_attention_backward.default,
             aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_cudnn_attention_backward.default}


def layout(t: torch.Tensor) -> str:
    """``row`` (the last two dims contiguous), ``col`` (their transpose is) or ``strided`` (a copy for BLAS)."""
    if t.dim() < 2:
        return "row"
    s0, s1 = t.stride(-2), t.stride(-1)
    rows, cols = t.shape[-2], t.shape[-1]
    if s1 == 1 or cols == 1:
        if s0 >= cols or rows == 1:
            return "row"
    if s0 == 1 or rows == 1:
        if s1 >= rows or cols == 1:
            return "col"
    return "strided"


@dataclass(frozen=True)
class GemmCall:
    """One matrix product as the dispatcher saw it."""

    phase: str  # "forward" or "backward"
    op: str
    dtypes: tuple[str, ...]
    layouts: tuple[str, ...]
    gflop: float


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class GemmLog(TorchDispatchMode):
    """Records every GEMM-class operator dispatched while active (``calls``), with its phase, dtypes and layouts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[GemmCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in PRODUCTS or func in CONVOLUTIONS or func in ATTENTION:
            self.calls.append(self._describe(func, args, out))
        return out

    @staticmethod
    def _describe(func, args, out) -> GemmCall:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        name = func._schema.name.removeprefix("aten::")
        if func in PRODUCTS:
            i, j = PRODUCTS[func]
            a, b = args[i], args[j]
            return GemmCall(phase, name, (_dtype(a), _dtype(b)), (layout(a), layout(b)),
                            2 * a.numel() * b.shape[-1] / 1e9)
        if func in CONVOLUTIONS:
            weight = args[1] if func is aten.convolution.default else args[2]
            result = out if func is aten.convolution.default else args[0]  # the output (its gradient)
            per_out = weight.shape[1] * math.prod(weight.shape[2:])
            gflop = 2 * result.numel() * per_out / 1e9 * (1 if func is aten.convolution.default else 2)
            return GemmCall(phase, name, tuple(_dtype(t) for t in tensors[:3]),
                            tuple("channels_last" if t.dim() == 4 and t.is_contiguous(
                                memory_format=torch.channels_last) else layout(t) for t in tensors[:3]), gflop)
        # SDPA: [B, H, T, D] queries, [B, Hkv, S, D] keys; two products, halved by the causal mask; the backward
        # counted as twice the forward.
        q, k = tensors[0], tensors[1]
        gflop = 2 * 2 * q.numel() * k.shape[-2] / 2 / 1e9 * (2 if "backward" in name else 1)
        return GemmCall(phase, name, tuple(_dtype(t) for t in tensors[:3]), tuple(layout(t) for t in tensors[:3]),
                        gflop)


def record_step(loss_fn, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> list[GemmCall]:
    """The GEMMs of ``loss_fn()`` (run under autocast to ``dtype``) and of its backward."""
    with GemmLog() as log:
        with torch.autocast(device, dtype=dtype):
            loss = loss_fn()
        loss.backward()
    return log.calls


def summarise(calls: list[GemmCall]) -> dict[tuple, list[float]]:
    """(phase, op, dtypes, layouts) -> [calls, GFLOP]."""
    table: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    for c in calls:
        row = table[(c.phase, c.op, c.dtypes, c.layouts)]
        row[0] += 1
        row[1] += c.gflop
    return dict(table)


def gflop_by_dtype(calls: list[GemmCall]) -> dict[str, float]:
    """GFLOP by "<phase> <first operand's dtype>" (the dtype the product runs in)."""
    out: dict[str, float] = defaultdict(float)
    for c in calls:
        out[f"{c.phase} {c.dtypes[0]}"] += c.gflop
    return {k: round(v, 4) for k, v in sorted(out.items())}


def main(argv: list[str] | None = None) -> None:
    from train_step import FIRST_TOKEN, build_hf, model_config  # benchmarks/ is on sys.path when run as a script

    from zaya.model import ZayaForCausalLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hf-experts", default="grouped_mm,eager")
    args = p.parse_args(argv)

    cfg = model_config(args)
    torch.manual_seed(0)
    ours = ZayaForCausalLM(cfg).train()
    models = {"zaya": ours, **{f"hf_{m}": build_hf(cfg, ours, m) for m in args.hf_experts.split(",") if m}}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(FIRST_TOKEN, cfg.vocab_size, (args.batch, args.seq), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], dim=1)
    for name, model in models.items():
        if name == "zaya":
            calls = record_step(lambda: model(ids, labels=targets).loss)
        else:
            calls = record_step(lambda: model(input_ids=ids, labels=ids).loss)
        print(f"# {name}: calls, GFLOP by (phase, op, dtypes, layouts)")
        for (phase, op, dtypes, layouts), (n, gflop) in sorted(summarise(calls).items()):
            print(f"#   {phase:<8} {op:<52} {','.join(dtypes):<26} {','.join(layouts):<30} {n:4d} {gflop:8.4f}")
        print(json.dumps({"model": name, "gflop": gflop_by_dtype(calls), "calls": len(calls),
                          "strided_operands": sum(lay == "strided" for c in calls for lay in c.layouts)}))


if __name__ == "__main__":
    main()
