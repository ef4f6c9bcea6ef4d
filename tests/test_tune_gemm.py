"""``zaya tune gemm`` and the hardware profile the tuned constants come from.

One quick fp32 sweep of the tiny config (a few seconds) is shared by the tests that read its outputs; every test
that reads or writes a profile points ``ZAYA_CACHE_DIR`` at its own temp directory and clears the profile cache.
"""

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zaya.config import ModelConfig, load_config
from zaya.core.errors import ConfigError
from zaya.model import loss as zloss
from zaya.model.info import forward_flops_per_token, model_info
from zaya.optim import newton_schulz as ns
from zaya.core.hardware import device_peak_flops
from zaya.core import hardware as profile
from zaya.core import units
from zaya.tune.gemm import command, options, predict, recommend, sweep, timing
from zaya.tune.gemm import shapes as gemm_shapes
from zaya.tune.gemm import text as gemm_text

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
CPU = torch.device("cpu")


def args(*argv):
    p = argparse.ArgumentParser()
    options.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def private_profile(tmp_path, monkeypatch):
    """A cache of this test's own: profiles written here are read back, and forgotten afterwards."""
    monkeypatch.setenv("ZAYA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    profile.clear_cache()
    yield tmp_path / "cache"
    profile.clear_cache()


@pytest.fixture(scope="module")
def quick_sweep(tmp_path_factory):
    """``zaya tune gemm --quick --dtype fp32 --json`` into a temp dir: (result, out dir, cache dir, stdout)."""
    tmp = tmp_path_factory.mktemp("tune-gemm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZAYA_CACHE_DIR", str(tmp / "cache"))
        mp.delenv(profile.PROFILE_ENV, raising=False)
        mp.chdir(ROOT)
        profile.clear_cache()
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            code = command.run(args("--quick", "--dtype", "fp32", "--config", str(TINY), "--out", str(tmp / "out"),
                                 "--json"))
        assert code == 0
        profile.clear_cache()
    return json.loads(buf.getvalue()), tmp / "out", tmp / "cache"


# --------------------------------------------------------------------------------------------- shapes and counts


@pytest.mark.parametrize("variant", [{}, {"attention": "gqa"}, {"router": "linear", "top_k": 2}])
def test_model_gemms_are_the_weight_flops_of_model_info(variant):
    cfg = dataclasses.replace(load_config(TINY).model, **variant)
    info = forward_flops_per_token(cfg, context=64)
    expected = sum(info.values()) - info["attention_scores"] - info["cca_convolutions"]
    assert sum(g.count * g.flops for g in gemm_shapes.model_gemms(cfg, 256)) == expected * 256


@pytest.mark.parametrize("shape", [{}, {"hidden_size": 320, "expert_hidden_size": 448},
                                   {"head_dim": 128, "num_query_heads": 2, "num_kv_heads": 1}])
def test_parameter_counts_equal_model_info(shape):
    cfg = dataclasses.replace(load_config(TINY).model, **shape)
    counts = predict.ParamCounter(cfg).counts(cfg)
    info = model_info(cfg)
    assert counts == {"active": info["params_active_non_embedding"], "total": info["params_non_embedding"]}


def test_scaled_widths_keep_the_config_rules():
    cfg = ModelConfig()  # ZAYA1-base: 2048 wide, 8/2 heads of 128, experts 2048
    assert gemm_shapes.default_widths(cfg) == [1024, 1536, 2048, 2560, 3072, 4096]
    c = gemm_shapes.scaled(cfg, 3072)
    assert (c.num_query_heads, c.num_kv_heads, c.head_dim, c.expert_hidden_size) == (12, 3, 128, 3072)
    assert gemm_shapes.scaled(cfg, 2048) == cfg


# -------------------------------------------------------------------------------------------------- the sweep


def test_quick_sweep_measures_every_kind_consistently(quick_sweep):
    result, out, _ = quick_sweep
    rows = result["measurements"]
    assert {r["kind"] for r in rows} == {"qkv", "o", "router_down", "router_mlp", "router_out", "experts_gate_up",
                                         "experts_down", "lm_head"}
    assert {r["tokens"] for r in rows} == set(gemm_shapes.QUICK_TOKENS) and result["widths"] == [128, 256]
    for r in rows:
        assert r["seconds"] > 0 and r["tflops"] > 0 and r["samples"] >= 3
        assert r["tflops"] == pytest.approx(2 * r["m"] * r["n"] * r["k"] / r["seconds"] / 1e12)
    grouped = [r for r in rows if r["groups"] > 1]
    assert grouped and all(r["impl"] == "grouped_mm" and r["groups"] == 8 for r in grouped)  # as the model runs them
    peak = result["peak"]["float32"]["flops"]
    assert peak >= max(r["tflops"] for r in rows) * 1e12 * 0.999


def test_quick_sweep_writes_json_heatmap_and_profile(quick_sweep):
    result, out, cache = quick_sweep
    key = profile.device_key(CPU)
    saved = json.loads((out / f"gemm-{key}.json").read_text())
    assert saved["measurements"] == result["measurements"]
    png = out / f"gemm-{key}-fp32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    prof = profile.read_profile(cache / "hardware" / f"{key}.json")
    assert prof.peak_flops == {}  # a --quick sweep's small square GEMM is no peak: MFU keeps its source
    assert prof.gemm["peak"]["float32"]["flops"] == pytest.approx(result["peak"]["float32"]["flops"])
    assert prof.gemm["recommendation"]["float32"]["hidden_size"] == result["recommendation"]["float32"]["best"][
        "hidden_size"]
    # The defaults of what the command does not measure stay.
    assert (prof.muon_block_rows, prof.loss_chunk_elements) == (256, 1 << 19)


def test_recommendation_is_within_the_budget(quick_sweep):
    result, _, _ = quick_sweep
    rec = result["recommendation"]["float32"]
    own = model_info(load_config(TINY).model)["params_active_non_embedding"]
    assert rec["budget"] == own and rec["budget_of"] == "active"
    assert rec["ranked"] and all(abs(r["params_active"] / own - 1) <= 0.1 for r in rec["ranked"])
    assert all(1 <= r["expert_hidden_size"] / r["hidden_size"] <= 4 for r in rec["ranked"])  # tiny's 2, x/ 2
    assert [r["score"] for r in rec["ranked"]] == sorted(r["score"] for r in rec["ranked"])
    assert rec["best"]["micro_batch_tokens"] in gemm_shapes.QUICK_TOKENS and rec["why"]


def test_from_saved_sweep_reranks_for_another_budget(quick_sweep, private_profile, capsys):
    _, out, _ = quick_sweep
    saved = next(out.glob("gemm-*.json"))
    assert command.run(args("--from", str(saved), "--budget", "3.2M", "--budget-of", "active", "--tolerance", "5%",
                         "--json")) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]["float32"]
    assert rec["budget"] == 3_200_000 and rec["ranked"]
    assert all(abs(r["params_active"] / 3.2e6 - 1) <= 0.05 for r in rec["ranked"])
    assert not (private_profile / "hardware").exists()  # --from measures nothing and writes no profile


def test_report_prints_table_and_recommendation(quick_sweep):
    result, _, _ = quick_sweep
    text = gemm_text.report(result)
    assert "fp32 GEMM throughput (forward), GFLOP/s" in text or "TFLOP/s, by tokens" in text
    assert "experts_gate_up" in text and "Recommended shapes (fp32" in text and "why:" in text
    assert "not measured by this command" in text


# ------------------------------------------------------------------------------------------- the pure functions


def test_rate_model_interpolates_in_log_space_and_flags_extrapolation():
    rows = [{"kind": "qkv", "pass": "fwd", "m": m, "n": s, "k": s, "tflops": t}
            for m, s, t in ((100, 100, 1.0), (10000, 100, 3.0), (100, 400, 2.0), (10000, 400, 4.0))]
    model = predict.RateModel(rows)
    assert model.rate("qkv", "fwd", 1000, 200, 200) == (pytest.approx(2.5e12), False)
    assert model.rate("qkv", "fwd", 10**6, 100, 100) == (pytest.approx(3e12), True)  # clamped
    assert recommend.saturation([(256, 1.0), (1024, 1.85), (4096, 2.0)]) == (1024, 2.0)


def test_recommend_prefers_the_shape_the_device_runs_faster():
    cfg = load_config(TINY).model
    widths, tokens = [192, 256, 320], [256, 1024]
    rows = []
    for w, g in gemm_shapes.swept_gemms(cfg, widths, tokens):
        rate = 1e-3 * (2.0 if w == 320 else 1.0)  # TFLOP/s: the widest GEMMs twice as fast
        rows.append({"dtype": "float32", "kind": g.kind, "pass": "fwd", "m": g.m, "n": g.n, "k": g.k,
                     "tflops": rate, "spread": 0.01})
    result = {"measurements": rows, "tokens": tokens, "widths": widths}
    own = predict.ParamCounter(cfg).counts(cfg)["total"]
    rec = recommend.recommend(result, cfg, None, "total", 0.1, 2048, 128, "float32")
    assert rec["budget"] == own
    assert rec["best"]["hidden_size"] == 320 and 0.2 < rec["best"]["vs_config"] <= 1.0
    assert abs(rec["best"]["params_total"] / own - 1) <= 0.1
    none = recommend.recommend(result, cfg, 10**5, "total", 0.1, 2048, 128, "float32")
    assert none["best"] is None and "widen --widths or --tolerance" in none["why"]


@pytest.mark.parametrize("argv, needle", [
    (("--dtype", "fp16"), "--dtype = 'fp16'"),
    (("--tokens", ""), "--tokens = '': empty"),
    (("--tokens", "256,-4"), "is not positive"),
    (("--widths", "abc"), "--widths = 'abc'"),
    (("--budget", "lots"), "--budget = 'lots'"),
    (("--tolerance", "2"), "--tolerance = '2'"),
    (("--repeats", "0"), "--repeats = 0"),
    (("--from", "x.json", "--config", "y.toml"), "--from and --config"),
])
def test_bad_options_are_config_errors_naming_the_option(argv, needle):
    with pytest.raises(ConfigError) as err:
        options.options_from_args(args(*argv))
    assert needle in str(err.value)


def test_parse_count_and_tokens():
    assert units.parse_count("760M", "--budget") == 760_000_000
    assert units.parse_count("8.3B", "--budget") == 8_300_000_000
    assert units.parse_count("1_234", "--budget") == 1234
    assert options.parse_ints("4k,256,1024,256", "--tokens", "") == [256, 1024, 4096]
    assert options.parse_dtypes("bf16,fp32,bfloat16") == ["bfloat16", "float32"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--device = 'cuda'"):
        command.run(args("--device", "cuda", "--quick", "--out", str(tmp_path), "--no-save"))


def test_missing_saved_sweep_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        command.run(args("--from", str(tmp_path / "none.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="not a `zaya tune gemm` result"):
        command.run(args("--from", str(bad)))


# ------------------------------------------------------------------------ the profile and the modules reading it


def test_profile_round_trip_and_update_keeps_other_fields(private_profile):
    assert profile.load_profile(CPU) == profile.HardwareProfile()  # no file: today's literals
    profile.update_profile(CPU, ddp_bucket_mb=50.0)
    path = profile.update_profile(CPU, peak_flops={"float32": 5e10}, loss_chunk_elements=1 << 16)
    assert path == private_profile / "hardware" / f"{profile.device_key(CPU)}.json"
    profile.clear_cache()
    p = profile.load_profile(CPU)
    assert (p.ddp_bucket_mb, p.peak_flops, p.loss_chunk_elements) == (50.0, {"float32": 5e10}, 1 << 16)
    assert p.device_key == profile.device_key(CPU) and p.path == str(path)


def test_consumers_read_the_profile(private_profile):
    cfg = ns.NSConfig(ns.iteration_coefficients((3.4445, -4.7750, 2.0315), 5), 1e-7, torch.bfloat16, "auto", (3,))
    assert ns.plan(cfg, 2048, 4096, CPU, batched=False) == ("gram", 8)
    assert not ns.stacked(512, 1024, CPU) and zloss._chunk_rows(4096, CPU) == 128
    profile.update_profile(CPU, muon_block_rows=512, muon_max_blocks=2, muon_cpu_small=1024,
                           loss_chunk_elements=1 << 16, peak_flops={"float32": 1.25e11})
    assert ns.plan(cfg, 2048, 4096, CPU, batched=False) == ("gram", 2)
    assert ns.plan(cfg, 2048, 4096, torch.device("meta"), batched=False) == ("gram", 1)  # not a CPU: no blocks
    assert ns.stacked(512, 1024, CPU)
    assert zloss._chunk_rows(4096, CPU) == 16  # 2^16 / 4096 rows, at least MIN_CHUNK_ROWS
    assert device_peak_flops(CPU, 0.0, "float32") == (1.25e11, "measured float32 peak, hardware profile "
                                                      f"{profile.profile_path(CPU)}")
    assert device_peak_flops(CPU, 7e9, "float32") == (7e9, "train.peak_flops")  # the config still wins
    # The loss still equals torch's with the profile's smaller chunks.
    logits, labels = torch.randn(100, 4096, requires_grad=True), torch.randint(0, 4096, (100,))
    got = zloss.cross_entropy(logits, labels)
    torch.testing.assert_close(got, torch.nn.functional.cross_entropy(logits, labels))


def test_bad_profile_files_are_config_errors_naming_the_file(private_profile, tmp_path, monkeypatch):
    path = profile.profile_path(CPU)
    path.parent.mkdir(parents=True)
    for text, needle in (("{not json", "not valid JSON"), ('{"version": 1, "speed": 3}', "unknown key(s) speed"),
                         ('{"version": 1, "muon_block_rows": "big"}', "'muon_block_rows' must be int"),
                         ('{"version": 1, "peak_flops": {"float32": -1}}', "peak_flops['float32']"),
                         ('{"version": 99}', "profile version 99")):
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            profile.load_profile(CPU, refresh=True)
        assert str(path) in str(err.value) and needle in str(err.value) and "delete" in str(err.value)
    monkeypatch.setenv(profile.PROFILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="ZAYA_HARDWARE_PROFILE"):
        profile.load_profile(CPU)


# ----------------------------------------------------------------------------------------------------- the CLI


def test_module_import_stays_light():
    code = "import sys, zaya.tune.gemm; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_cli_quick_sweep(tmp_path, private_profile, monkeypatch, capsys):
    """The text report, through main in this process (a `zaya` subprocess would only add a torch start-up)."""
    from zaya.cli import main

    monkeypatch.chdir(ROOT)
    argv = ["tune", "gemm", "--quick", "--dtype", "fp32", "--tokens", "64", "--widths", "128,256", "--config",
            str(TINY), "--out", str(tmp_path / "out")]
    code = main(argv)
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "Recommended shapes (fp32" in printed.out and "hardware profile:" in printed.out
    assert "--quick leaves peak_flops as it was" in printed.out
    assert (private_profile / "hardware").is_dir() and list((tmp_path / "out").glob("gemm-*-fp32.png"))
    assert main([*argv[:2], "--dtype", "int8"]) == 2 and "--dtype = 'int8'" in capsys.readouterr().err


def test_dips_are_measured_again():
    cfg = load_config(TINY).model
    widths = [128, 256, 384]
    points = gemm_shapes.swept_gemms(cfg, widths, [256, 1024])
    done = {g: {"fwd": {"tflops": 1.0}} for _, g in points}
    slow = next(g for w, g in points if w == 256 and g.kind == "qkv" and g.m == 1024)
    done[slow]["fwd"]["tflops"] = 0.5  # half its neighbours' rate: interference, or a slow shape
    assert sweep.dips(points, done, widths) == [slow]
    done[slow]["fwd"]["tflops"] = 0.8  # within 75 %: left alone
    assert sweep.dips(points, done, widths) == []
    done[slow]["fwd"]["tflops"] = 1.0
    bigger = next(g for w, g in points if w == 256 and g.kind == "qkv" and g.m == 256)
    done[bigger]["fwd"]["tflops"] = 0.5  # slower at fewer tokens than at more: expected, not a dip ...
    one_width = [(w, g) for w, g in points if w == 256]
    assert sweep.dips(one_width, done, [256]) == []  # ... when it has no width neighbours to compare with


def test_backward_gemms_have_the_model_backward_shapes():
    for g, impls in ((gemm_shapes.Gemm("qkv", 64, 32, 16), ("mm",)),
                     (gemm_shapes.Gemm("experts_gate_up", 64, 32, 16, groups=4), ("grouped_mm", "loop"))):
        w = (32, 16) if g.groups == 1 else (4, 32, 16)
        for impl in impls:
            shapes = {p: tuple(timing.gemm_call(g, p, torch.float32, CPU, impl)().shape)
                      for p in gemm_shapes.PASSES}
            assert shapes == {"fwd": (64, 32), "dgrad": (64, 16), "wgrad": w}


def test_backward_sweep_feeds_the_prediction(tmp_path, private_profile, capsys):
    assert command.run(args("--quick", "--backward", "--dtype", "fp32", "--tokens", "64", "--widths", "128",
                         "--config", str(TINY), "--out", str(tmp_path), "--no-save", "--no-plot", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passes"] == ["fwd", "dgrad", "wgrad"]
    assert {r["pass"] for r in result["measurements"]} == set(gemm_shapes.PASSES)
    assert result["recommendation"]["float32"]["config"]["tokens_per_s"] > 0
    assert not (private_profile / "hardware").exists() and not list(tmp_path.glob("*.png"))


def test_a_full_sweep_writes_the_peak_that_mfu_then_uses(tmp_path, private_profile, capsys):
    assert command.run(args("--dtype", "fp32", "--tokens", "64", "--widths", "128", "--repeats", "1", "--config",
                         str(TINY), "--out", str(tmp_path), "--no-plot", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    peak = result["peak"]["float32"]["flops"]
    assert result["peak"]["float32"]["square"]["size"] == 1024 and peak > 0
    profile.clear_cache()
    assert device_peak_flops(CPU, 0.0, torch.float32) == (peak, "measured float32 peak, hardware profile "
                                                          f"{result['profile']}")
