"""`benchmarks/cca_attention.py --quick`: the three attention variants run, agree where they must, and report their
figures as JSON lines (a smoke test of the benchmark's whole path; its timings mean nothing)."""

from __future__ import annotations

from bench_helpers import run_benchmark


def test_quick_cca_benchmark_reports_every_variant(monkeypatch, capsys):
    lines = run_benchmark(monkeypatch, capsys, "cca_attention.py", "--quick")
    machine, rows, final = lines[0], lines[1:-1], lines[-1]
    assert machine["machine"] and isinstance(machine["bf16_native"], bool) and machine["bf16_slowdown"] > 0
    variants = [r for r in rows if "variant" in r]
    assert [r["variant"] for r in variants] == ["ours_cca", "ours_mha", "hf_cca"]
    for r in variants:
        assert r["shape"] == "tiny" and r["dtype"] == "fp32" and r["tokens"] == 128 and r["repeats"] == 2, r
        assert r["median_s"] > 0 and len(r["times_s"]) == 2 and r["speedup_vs_hf"] > 0, r
    assert variants[2]["speedup_vs_hf"] == 1.0
    (summary,) = [r for r in rows if r.get("summary")]
    # Same weights in ours and transformers' CCA: outputs and every gradient agree to fp32 rounding.
    assert summary["out_rel_err"] < 1e-5 and summary["grad_rel_err"] < 1e-5, summary
    assert summary["target"] == 1.2 and summary["target_met"] == (summary["speedup_vs_hf"] >= 1.2)
    # The printed medians are rounded to 1e-4 s and the ratio to 1e-3, both from the unrounded medians: the
    # ratio of the printed medians may differ by their rounding (up to 5e-5 s each) plus the ratio's own.
    hf_s, ours_s, ratio = summary["hf_cca_s"], summary["ours_cca_s"], summary["speedup_vs_hf"]
    rounding = (hf_s / ours_s) * (5e-5 / hf_s + 5e-5 / ours_s) + 5e-4
    assert abs(ratio - hf_s / ours_s) <= rounding + 1e-9, summary
    assert final["final"] and final["primary"] == ["tiny/fp32"] and "tiny/fp32" in final["speedups"]
