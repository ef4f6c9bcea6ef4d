"""zaya.tune.kernel_trace / zaya.tune.cost: FLOPs and bytes of known kernels, a tiny step against torch's
flop counter, the prediction's monotonicity in peak and bandwidth, and the pieces of the price against hand-computed
cases: host and device clocks, wave quantisation, the measured GEMM curve, row-wise occupancy."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from zaya.config import ModelConfig
from zaya.tune.cost import DEVICES, Device, curve_efficiency, kernel_seconds, predict, timeline, wave_efficiency
from zaya.tune.kernel_trace import ATTENTION, GEMM, OTHER, Kernel, KernelRecorder, gpu_plans, trace_step

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


def test_host_ops_and_syncs_recorded():
    """Ops that launch nothing are counted on the next kernel; a host read marks it as issued after a wait."""
    def run():
        x, w = torch.empty(8, 4), torch.empty(4, 4)
        y = torch.mm(x.view(4, 8).t(), w)  # two allocations and two views, then a kernel
        y.sum().item()  # a kernel (sum), then a host read
        y.add(1)
    mm, total, add = _record(run)
    assert (mm.op, mm.host_ops, mm.sync) == ("mm", 4, False)
    assert (total.host_ops, total.sync) == (0, False)
    assert (add.op, add.host_ops, add.sync) == ("add", 1, True)


def test_timeline_overlaps_host_and_device():
    """Hand-computed clocks: the device-bound stream hides the host, the host-bound one shows it, a host read waits
    for the device, and a synchronous device (a CPU) adds both."""
    def total(issues, asynchronous=True):
        return sum(t for t, _ in timeline(issues, asynchronous))

    assert total([(1, 10, False), (1, 10, False)]) == 21  # issued at 1 and 2; the device ends at 11, 21
    assert total([(5, 1, False)] * 3) == 16  # issued at 5, 10, 15; the last runs 15-16
    assert total([(1, 10, False), (1, 1, True)]) == 13  # the host waits until 11, issues at 12, runs 12-13
    assert total([(1, 10, False), (1, 10, False)], asynchronous=False) == 22
    assert timeline([(5, 1, False), (1, 10, False)], True) == [(6, 1), (10, 10)]  # the host's 5, then hidden
    assert timeline([(1, 10, False), (20, 1, False)], True) == [(11, 10), (11, 1)]  # the device waits 10 for it


_TOY = Device("toy", {"float32": 1e12, "bfloat16": 1e12}, 1e9, gemm_efficiency=1.0,
              grouped_gemm_efficiency=0.25, attention_efficiency=1.0, bandwidth_efficiency=1.0, launch_s=5e-6,
              host_op_s=1e-6, compute_units=4, tile=(128, 256))


def _kernel(kind=GEMM, flops=0.0, nbytes=0, tiles=(0, 0, 0), rows=0, host_ops=0, op="k"):
    return Kernel(op, kind, flops, nbytes, "float32", "p", "forward", tiles, rows=rows, host_ops=host_ops)


def test_wave_quantisation():
    """Output tiles of 128 x 256 over 4 units: 4 tiles fill one wave; 6 tiles take two waves (6 / 8 busy); a
    grouped GEMM's tiles counted per group: 3 groups of one tile fill 3 of 4."""
    assert wave_efficiency(_kernel(tiles=(1, 256, 512)), _TOY) == 1.0
    assert wave_efficiency(_kernel(tiles=(1, 384, 512)), _TOY) == 0.75
    assert wave_efficiency(_kernel(tiles=(3, 100, 200)), _TOY) == 0.75
    k = _kernel(flops=6e9, tiles=(1, 384, 512))
    assert kernel_seconds(k, _TOY) == pytest.approx(6e9 / (1e12 * 0.75))
    skinny = _kernel(flops=1e6, nbytes=10 ** 6, tiles=(1, 16, 512))  # the memory roofline: 1 ms of bytes
    assert kernel_seconds(skinny, _TOY) == pytest.approx(1e-3)


def test_grouped_gemm_efficiency():
    """A grouped GEMM (aten's or zaya's) runs at the grouped efficiency times its waves; a plain one of the same
    shape at the plain efficiency."""
    for op in ("_grouped_mm", "grouped_mm"):
        assert kernel_seconds(_kernel(flops=1e9, tiles=(4, 128, 256), op=op), _TOY) == pytest.approx(1e9 / 0.25e12)
        assert kernel_seconds(_kernel(flops=1e9, tiles=(3, 128, 256), op=op), _TOY) == \
            pytest.approx(1e9 / (0.25e12 * 0.75))
    assert kernel_seconds(_kernel(flops=1e9, tiles=(4, 128, 256), op="bmm"), _TOY) == pytest.approx(1e9 / 1e12)


def test_gemm_loads_add_where_they_do_not_overlap():
    """A device whose GEMM loads overlap compute takes the roofline's max; one whose do not (a CPU) the sum of the
    compute and the bytes' time; other kernels stay memory-bound either way."""
    k = _kernel(flops=1e9, nbytes=10 ** 6, tiles=(1, 256, 512))  # one full wave: 1 ms of compute, 1 ms of bytes
    serial = dataclasses.replace(_TOY, gemm_loads_overlap=False)
    assert kernel_seconds(k, _TOY) == pytest.approx(1e-3)
    assert kernel_seconds(k, serial) == pytest.approx(1e-3 + 1e-3)
    assert kernel_seconds(_kernel(OTHER, nbytes=10 ** 6), serial) == pytest.approx(1e-3)


def test_gemm_curve_by_flops():
    """A measured curve: interpolated in log FLOPs, the ends beyond it, a grouped GEMM read at its FLOPs per
    group."""
    curve = ((2e3, 0.5), (2e6, 1.0))
    assert curve_efficiency(2e3 * 10 ** 1.5, curve) == pytest.approx(0.75)
    assert curve_efficiency(1.0, curve) == 0.5 and curve_efficiency(1e12, curve) == 1.0
    cpu = dataclasses.replace(_TOY, gemm_curve=curve, compute_units=1, asynchronous=False)
    grouped = _kernel(flops=4 * 2e3, tiles=(4, 10, 10))
    assert kernel_seconds(grouped, cpu) == pytest.approx(4 * 2e3 / (1e12 * 0.5))


def test_row_wise_occupancy():
    """A softmax over 2 rows keeps 2 of 4 units busy: its bytes take twice as long; 8 rows fill the device."""
    assert kernel_seconds(_kernel(OTHER, nbytes=10 ** 6, rows=2), _TOY) == pytest.approx(2e-3)
    assert kernel_seconds(_kernel(OTHER, nbytes=10 ** 6, rows=8), _TOY) == pytest.approx(1e-3)


def test_predict_host_bound_and_device_bound():
    """Tiny kernels: the host's issue time is the step (5 us a launch plus 1 us a view); large ones hide it."""
    tiny = [_kernel(OTHER, nbytes=100, host_ops=1)] * 10
    p = predict(tiny, _TOY)
    assert p.seconds == pytest.approx(10 * 6e-6 + 100 / 1e9)
    # the first adds the host's 6 us and its 0.1 us; each later one 6 us, 0.1 of it running, the rest waiting
    assert p.bound["memory"] == pytest.approx(10 * 100 / 1e9) and p.bound["host"] == pytest.approx(6e-6 + 9 * 5.9e-6)
    big = [_kernel(OTHER, nbytes=10 ** 6, host_ops=1)] * 10
    assert predict(big, _TOY).seconds == pytest.approx(6e-6 + 10 * 1e-3)
    assert predict(big, dataclasses.replace(_TOY, asynchronous=False)).seconds == pytest.approx(10 * (6e-6 + 1e-3))


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
    assert all(r["hot_gflops"] > 0 and r["cold_gflops"] > 0 for r in out["cold_gemms"])
    host = out["moe_block_host"]
    assert host["host_ms"] > 0 and host["kernels"] > 0 and host["model_host_ms_h200"] > 0
    dev = out["moe_block_device"]
    assert 0 < dev["host_issue_ms"] <= dev["iteration_ms"] and dev["top_kernels_us"]
    assert set(dev["grouped_mm_tflops_alone"]) == {"gate_up forward", "gate_up input gradient",
                                                   "gate_up weight gradient", "down forward"}
