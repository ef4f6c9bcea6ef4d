"""Issue 36's candidate for the CCA convolutions, explicit taps over time (benchmarks/cca_attention.py's
``taps_convolutions``), against the model's conv2d path and a channels-first ``F.conv1d`` reference, and the
benchmark modes that time it (``cca_attention.py --convolutions``, ``compile.py --cca-taps``)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from bench_helpers import ROOT, run_benchmark
from zaya.config import ModelConfig
from zaya.model.attention import Attention

sys.path.insert(0, str(ROOT / "benchmarks"))
from cca_attention import taps_convolutions  # noqa: E402


def reference(att: Attention, packed: torch.Tensor) -> torch.Tensor:
    """Both convolutions as plain channels-first ``F.conv1d`` (no padding: the history is in ``packed``)."""
    x = F.conv1d(packed, att.conv_depthwise.weight, att.conv_depthwise.bias, groups=att.conv_depthwise.groups)
    return F.conv1d(x, att.conv_grouped.weight, att.conv_grouped.bias, groups=att.conv_grouped.groups)


def layer(depthwise: int, grouped: int, kv_heads: int) -> Attention:
    torch.manual_seed(0)
    att = Attention(ModelConfig(vocab_size=97, hidden_size=64, num_layers=1, num_query_heads=4,
                                num_kv_heads=kv_heads, head_dim=16, cca_depthwise_kernel=depthwise,
                                cca_grouped_kernel=grouped))
    with torch.no_grad():
        att.conv_depthwise.bias.normal_()
        att.conv_grouped.bias.normal_()
    return att


@pytest.mark.parametrize("depthwise,grouped,kv_heads,batch,steps", [
    (2, 2, 2, 3, 7),  # the default kernels, odd T, batch > 1
    (3, 1, 1, 2, 1),  # a decode step (T = 1), a 1x1 grouped convolution, one KV head
    (1, 4, 4, 1, 5),  # no depthwise reach, MHA-like groups
])
def test_taps_match_the_model_and_a_conv1d_reference(depthwise, grouped, kv_heads, batch, steps):
    """Output and every gradient (input with its history, both weights, both biases), fp32 and bf16, within a few
    units of the dtype's epsilon of the largest value. Both paths sum the same products (at most 16 x 4 per
    value) in another order, and in bf16 the taps also round the depthwise output and each tap's partial sum where
    the convolution rounds once: measured at most 3.6 eps in fp32 and 1.4 eps in bf16, so 8 and 4 eps."""
    for dtype, ulps in ((torch.float32, 8), (torch.bfloat16, 4)):
        tol = ulps * torch.finfo(dtype).eps
        att = layer(depthwise, grouped, kv_heads).to(dtype)
        params = [att.conv_depthwise.weight, att.conv_depthwise.bias, att.conv_grouped.weight, att.conv_grouped.bias]
        channels = att.conv_depthwise.in_channels
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, att.conv_reach + steps, channels, generator=g).to(dtype).requires_grad_(True)
        upstream = torch.randn(batch, steps, channels, generator=g).to(dtype).mT
        results = []
        for fn in (reference, Attention._convolutions, taps_convolutions):
            out = fn(att, x.mT)  # [B, C, reach + T] view of token-major memory, as the seam hands it
            results.append([out, *torch.autograd.grad(out, [x, *params], upstream)])
        ref, model, taps = results
        assert taps[0].shape == (batch, channels, steps) and taps[0].mT.is_contiguous()
        for name, r, m, t in zip(("out", "x", "dw", "db", "gw", "gb"), ref, model, taps):
            scale = r.double().abs().max()
            assert (t.double() - r.double()).abs().max() <= tol * scale, (dtype, name)
            assert (m.double() - r.double()).abs().max() <= tol * scale, (dtype, name)


def test_convolutions_benchmark_times_both_paths(monkeypatch, capsys):
    machine, *rows = run_benchmark(monkeypatch, capsys, "cca_attention.py", "--convolutions", "--shapes", "tiny",
                                   "--tokens", "32", "--repeats", "1", "--dtype", "fp32,bf16", "--threads", "1",
                                   "--quiet-timeout", "0")
    assert machine["machine"] and machine["threads"] == 1
    assert [(r["shape"], r["dtype"], r["batch"], r["tokens"]) for r in rows] == [("tiny", "fp32", 16, 32),
                                                                                ("tiny", "bf16", 16, 32)]
    for r in rows:
        assert r["agree"] and r["conv2d_ms"] > 0 and r["taps_ms"] > 0 and r["taps_speedup"] > 0, r
    assert rows[0]["max_rel_err"] < 1e-5, rows[0]  # fp32: summation order only


@pytest.mark.slow
def test_compile_benchmark_times_taps_copies(monkeypatch, capsys):
    """``compile.py --cca-taps`` on its micro shape through aot_eager (the path, not the timings). Slow (15 s: two
    more copies to trace); the fast tests cover the taps themselves and tests/test_compile.py the script's path."""
    from zaya.core.compile import CACHE_ENV
    from zaya.train import compile as compile_module

    monkeypatch.setattr(compile_module, "BACKEND", compile_module.BACKEND)  # the script sets it
    monkeypatch.setenv(CACHE_ENV, "")
    _, row, _ = run_benchmark(monkeypatch, capsys, "compile.py", "--shapes", "micro", "--backend", "aot_eager",
                              "--steps", "1", "--warmup", "0", "--threads", "1", "--quiet-below", "1", "--cca-taps")
    assert len(row["taps_eager_times_s"]) == len(row["taps_compiled_times_s"]) == 1, row
    assert row["taps_eager_gain"] > 0 and row["taps_compiled_gain"] > 0 and row["taps_compile_s"] > 0, row
    assert row["max_loss_rel_diff"] < 1e-5, row  # four copies of the same model, the same batches
