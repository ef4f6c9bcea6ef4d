"""`benchmarks/serve.py --quick --skip-load`: generate against transformers' on the same weights, outputs checked,
and the floor figures (prefill, the decode steps' weight GEMMs and KV-cache reads alone) reported (its timings
mean nothing)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_quick_serve_benchmark_reports_speed_and_floor(monkeypatch, capsys):
    # The script as `python benchmarks/serve.py --quick --skip-load` runs it from the repository root, in this
    # process (no second interpreter importing torch and transformers; it sets the one thread the tests use).
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["serve.py", "--quick", "--skip-load"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(ROOT / "benchmarks/serve.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
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
