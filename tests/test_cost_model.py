"""zaya.tune.kernel_trace / zaya.tune.cost: FLOPs and bytes of known kernels, a tiny step against torch's
flop counter, and the prediction's monotonicity in peak and bandwidth."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from zaya.config import ModelConfig
from zaya.tune.cost import DEVICES, predict
from zaya.tune.kernel_trace import ATTENTION, GEMM, KernelRecorder, gpu_plans, trace_step

CFG = ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=16,
                  num_experts=4, expert_hidden_size=64, router_hidden_size=16)


@pytest.fixture(scope="module")
def kernels():
    return trace_step(CFG, 2, 32, dtype="bfloat16", plans=gpu_plans(1 << 28))


def _record(fn):
    with FakeTensorMode(), KernelRecorder() as rec:
        fn()
    return rec.kernels


def test_gemm_flops_and_bytes():
    def run():
        x, w = torch.empty(64, 32), torch.empty(16, 32)
        torch.mm(x, w.t())
    (k,) = _record(run)
    assert k.kind == GEMM and k.flops == 2 * 64 * 32 * 16
    assert k.bytes == 4 * (64 * 32 + 16 * 32 + 64 * 16)


def test_grouped_gemm_flops():
    """Both forms of the expert GEMM: rows grouped into experts ([M, K] x [E, K, N]) and the weight gradient grouped
    over the rows ([N, M] x [M, K] -> [E, N, K]): 2 M N K either way, whatever the split."""
    from zaya.model import moe  # noqa: F401  (registers zaya::grouped_mm)

    m, k, n, e = 96, 32, 48, 4

    def run():
        offs = torch.tensor([10, 40, 40, 96], dtype=torch.int32)
        torch.ops.zaya.grouped_mm(torch.empty(m, k), torch.empty(e, k, n), offs)
        torch.ops.zaya.grouped_mm(torch.empty(n, m), torch.empty(m, k), offs)
    kernels = [x for x in _record(run) if x.kind == GEMM]
    assert [x.flops for x in kernels] == [2 * m * k * n, 2 * m * k * n]


def test_copy_bytes_and_views_free():
    def run():
        src, dst = torch.empty(1000), torch.empty(1000)
        dst.view(10, 100).t()
        dst.copy_(src)
    (k,) = _record(run)
    assert k.flops == 0 and k.bytes == 3 * 4000  # reads dst and src, writes dst


def test_causal_attention_flops():
    b, h, s, d = 1, 2, 64, 16

    def run():
        q = torch.empty(b, h, s, d)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    (k,) = _record(run)
    assert k.kind == ATTENTION and k.flops == 0.5 * 4 * b * h * s * s * d  # QK^T and PV, half computed


def test_step_gemm_flops_match_torch_flop_counter():
    """Forward + backward of the tiny model: every GEMM torch's counter knows (mm, addmm, bmm) gives its FLOPs."""
    from zaya.tune.activation_trace import fake_model

    cfg = dataclasses.replace(CFG, num_layers=1)
    with fake_model(cfg, 64, dtype="float32", max_loss_chunks=None) as model:
        ids = torch.randint(3, cfg.vocab_size, (2, 32))
        counter = FlopCounterMode(display=False)
        rec = KernelRecorder()
        with counter, rec:
            model(ids, labels=ids).loss.backward()
    ops = ("mm", "addmm", "bmm", "baddbmm")
    theirs = sum(v for op, v in counter.get_flop_counts()["Global"].items() if op.__name__ in ops)
    ours = sum(k.flops for k in rec.kernels if k.op in ops)
    assert theirs > 0 and ours == theirs


def test_prediction_monotone_in_peak_and_bandwidth(kernels):
    h200 = DEVICES["h200"]
    base = predict(kernels, h200).seconds
    faster = dataclasses.replace(h200, peak_flops={k: 2 * v for k, v in h200.peak_flops.items()})
    wider = dataclasses.replace(h200, bandwidth=2 * h200.bandwidth)
    assert predict(kernels, faster).seconds <= base and predict(kernels, wider).seconds <= base
    slower = dataclasses.replace(h200, peak_flops={k: v / 100 for k, v in h200.peak_flops.items()}, bandwidth=1e9)
    assert predict(kernels, slower).seconds > base


def test_compiled_fuses_block_kernels(kernels):
    eager, compiled = predict(kernels, DEVICES["h100"]), predict(kernels, DEVICES["h100"], compiled=True)
    assert compiled.launches < eager.launches and compiled.seconds <= eager.seconds
    assert set(eager.by_phase) == {"forward", "backward", "clip", "optimizer"}
    assert {"moe experts", "attention", "head and loss"} <= set(eager.by_part)


def test_cli_predicts_and_refuses_unknown_device(capsys):
    import json

    from zaya.cli import main

    args = ["tune", "cost", "--config", "configs/tiny.toml", "--layers", "1", "--micro-batch", "1", "--seq-len",
            "32", "--device", "h200"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["compiled"] for p in out["predictions"]] == [False, True]
    assert all(p["step_ms"] > 0 and 0 < p["mfu"] < 1 for p in out["predictions"])
    assert main(args[:-1] + ["a100"]) == 2
    assert "unknown device(s) a100" in capsys.readouterr().err


def test_benchmark_smoke():
    """benchmarks/cost_model.py --smoke: every validation row and prediction is produced (micro model)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "cost_model.py"), "--smoke"], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert len(out["gpu_validation"]) == 7 and len(out["cpu_validation"]) == 1
    assert all(r["predicted_ms"] > 0 for r in out["gpu_validation"] + out["cpu_validation"])
    assert {r["variant"] for r in out["zaya1_base_4k"]["rows"]} >= {"eager", "compiled (blocks)"}
