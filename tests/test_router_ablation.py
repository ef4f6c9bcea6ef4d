"""`benchmarks/router_ablation.py --quick`: every variant trains through the real trainer and reports its figures."""

from __future__ import annotations

from bench_helpers import run_benchmark


def test_quick_ablation_reports_every_variant(tmp_path, micro_config, monkeypatch, capsys):
    # runs finishing in a test draw no plots (tests/conftest.py)
    lines = run_benchmark(monkeypatch, capsys, "router_ablation.py", "--quick", "--config",
                          str(micro_config(tmp_path / "unused")), "--out", str(tmp_path / "runs"))
    results, summary = lines[:-1], lines[-1]
    assert [r["variant"] for r in results] == ["zaya-adaptive", "zaya-adamw", "linear-bias", "linear-aux"]
    assert summary["summary"] and summary["steps"] == 6
    for r in results:
        assert 0 < r["val_loss"] < 10 and r["tokens_per_s"] > 0 and r["steps_in_last_third"] == 2, r
        assert r["load_max_over_mean_mean"] >= 1.0 and r["flip_rate_mean"] is not None, r
    # The linear router has no skip class and no EDA/MLP: fewer parameters than the ZAYA1 router's model.
    assert results[2]["parameters"] == results[3]["parameters"] < results[0]["parameters"] == results[1]["parameters"]
    # Each variant really ran with its settings (the resolved config of each run).
    config = (tmp_path / "runs" / "linear-aux" / "config.toml").read_text()
    assert 'router = "linear"' in config and "router_aux_loss_coef = 0.01" in config
    assert 'router_balancing = "none"' in config
