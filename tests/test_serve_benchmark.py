"""`benchmarks/serve.py --quick --skip-load`: generate against transformers' on the same weights, outputs checked,
and the floor figures (prefill, the decode steps' weight GEMMs and KV-cache reads alone) reported (its timings
mean nothing)."""

from __future__ import annotations

from bench_helpers import run_benchmark


def test_quick_serve_benchmark_reports_speed_and_floor(monkeypatch, capsys):
    rows = run_benchmark(monkeypatch, capsys, "serve.py", "--quick", "--skip-load")
    runs = [r for r in rows if "batch" in r]
    assert [r["batch"] for r in runs] == [1, 8]
    for r in runs:
        assert r["zaya_equals_forward_argmax"] and r["zaya_equals_hf"], r
        # generate's first token comes from the prefill; every later one from a decode step the hooks saw
        assert r["decode_steps"] == r["new_tokens"] - 1, r
        floor = r["prefill_s"] + r["decode_gemm_floor_s"] + r["decode_cache_floor_s"]
        assert r["prefill_s"] > 0 and r["hf_prefill_s"] > 0 and r["decode_gemm_floor_s"] > 0, r
        assert r["decode_cache_floor_s"] > 0, r
        # the floor leaves out everything but the prefill, the GEMMs and the cache reads: generate takes longer
        assert r["zaya_s"] > floor, r
        assert abs(r["floor_speedup"] - r["hf_s"] / floor) < 1e-9, r
