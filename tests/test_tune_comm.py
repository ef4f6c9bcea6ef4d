"""``zaya tune comm``: the option checks, the bandwidth conventions and the recommendation (pure functions on
synthetic curves), a quick 2-rank gloo sweep end to end (profile written into the tests' private cache), and DDP /
FSDP2 picking the profile's settings up in ``zaya.distributed.parallel.wrap``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import run_ok
from zaya.core.errors import ConfigError
from zaya.tune import comm
from zaya.core import hardware as hwprofile

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    comm.add_arguments(p)
    return p.parse_args(list(argv))


def _rows(op: str, n: int, sizes: list[int], bw) -> list[dict]:
    """Synthetic measurements: bus bandwidth ``bw(size)`` GB/s, times consistent with it."""
    rows = []
    for s in sizes:
        b = bw(s)
        t = s * comm.bus_factor(op, n) / (b * 1e9)
        rows.append({"op": op, "ranks": n, "bytes": s, "busbw_gbps": b, "algbw_gbps": b / comm.bus_factor(op, n),
                     "time_s": t, "impl": op, "impl_note": ""})
    return rows


SIZES = [4096 << i for i in range(15)]  # 4 KiB .. 64 MiB


def _saturating_at(knee: int, peak: float = 100.0):
    """Bandwidth rising linearly (log-spaced, so doubling) up to ``knee``, then flat at ``peak``."""
    return lambda s: peak * min(1.0, s / knee)


# --- pure functions ------------------------------------------------------------------------------------------
def test_bus_factors_follow_nccl_tests():
    assert comm.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert comm.bus_factor(op, 4) == pytest.approx(3 / 4)
    assert comm.bus_factor("broadcast", 4) == 1.0
    with pytest.raises(ValueError):
        comm.bus_factor("gossip", 2)


def test_parse_sizes():
    assert comm.parse_sizes("4K..64K") == [4096, 8192, 16384, 32768, 65536]
    assert comm.parse_sizes("1M,4KiB,1M") == [4096, MiB]
    assert comm.parse_sizes("4K..64M")[0] == 4096 and comm.parse_sizes("4K..64M")[-1] == 64 * MiB
    for bad in ("", "12Q", "64M..4K", "0", "-4K"):
        with pytest.raises(ConfigError):
            comm.parse_sizes(bad)


def test_bucket_is_where_all_reduce_saturates():
    """Curves that saturate at 8 MiB recommend an 8 MiB bucket; the largest rank count decides."""
    rows = (_rows("all_reduce", 2, SIZES, _saturating_at(2 * MiB, 50.0))
            + _rows("all_reduce", 4, SIZES, _saturating_at(8 * MiB)))
    rec = comm.recommend(rows)
    assert rec["ranks"] == 4
    assert rec["ddp_bucket_mb"] == 8.0
    assert rec["bucket_mb_by_ranks"] == {"2": 2.0, "4": 8.0}
    assert "8 MiB" in rec["reasons"]["ddp_bucket_mb"] and "still be rising" not in rec["reasons"]["ddp_bucket_mb"]


def test_bucket_bounds_and_unsaturated_curve():
    small = comm.recommend(_rows("all_reduce", 2, SIZES, _saturating_at(64 * 1024)))
    assert small["ddp_bucket_mb"] == 1.0 and "kept within [1, 256] MiB" in small["reasons"]["ddp_bucket_mb"]
    rising = comm.recommend(_rows("all_reduce", 2, SIZES, lambda s: float(s)))
    assert rising["ddp_bucket_mb"] == 64.0 and "still be rising" in rising["reasons"]["ddp_bucket_mb"]
    huge = comm.recommend(_rows("all_reduce", 2, SIZES + [1 << 30], lambda s: float(s)))
    assert huge["ddp_bucket_mb"] == 256.0
    with pytest.raises(ValueError):
        comm.recommend(_rows("all_gather", 2, SIZES, _saturating_at(MiB)))


def test_fsdp_and_zero1_recommendation():
    n = 4
    rows = []
    for op in ("all_reduce", "all_gather", "broadcast"):
        rows += _rows(op, n, SIZES, _saturating_at(8 * MiB))
    model = {"config": "m.toml", "params": 100_000_000, "block_params": 2 * MiB, "num_blocks": 8,
             "param_dtype_bytes": 2, "dtype": "bfloat16"}
    # 4 MiB blocks of bf16 reach half the peak of a curve saturating at 8 MiB
    rec = comm.recommend(rows, model, device_memory=80 * (1 << 30))
    assert rec["fsdp"]["block_bytes"] == 4 * MiB
    assert rec["fsdp"]["fraction_of_peak"] == pytest.approx(0.5)
    assert rec["fsdp"]["reshard_after_forward"] is False  # 150 MB gathered of 80 GiB
    assert comm.recommend(rows, model, device_memory=1 << 30)["fsdp"]["reshard_after_forward"] is True
    assert "reshard_after_forward" not in comm.recommend(rows, model)["fsdp"]  # memory unknown: not decided
    assert rec["zero1"]["param_sync"] == "broadcast" and rec["zero1"]["param_bytes"] == 400_000_000
    assert {"ddp_bucket_mb", "zero1", "fsdp"} <= set(rec["reasons"])


def test_expert_all_to_all_at_each_degree():
    """--config: a training step's expert all-to-all at every degree dividing the experts and the ranks, priced from
    the measured all-to-all curve at one exchange's message size, beside the gradient all-reduce."""
    n = 8
    rows = (_rows("all_reduce", n, SIZES, _saturating_at(8 * MiB)) + _rows("all_to_all", 2, SIZES, lambda s: 20.0)
            + _rows("all_to_all", 4, SIZES, _saturating_at(64 * MiB, 40.0)))
    # 2 micro-batches of 1024 tokens per rank (global 16,384 over 8 ranks), top-2 of 1024 wide, bf16: 4 MiB messages
    model = {"config": "m.toml", "params": 100_000_000, "block_params": 2 * MiB, "num_blocks": 8,
             "param_dtype_bytes": 2, "dtype": "bfloat16", "num_layers": 8, "num_experts": 12, "top_k": 2,
             "hidden_size": 1024, "micro_tokens": 1024, "global_batch_tokens": 16384}
    rec = comm.recommend(rows, model)
    ep = rec["expert_parallel"]
    assert [d["ep"] for d in ep["degrees"]] == [2, 4]  # 8 does not divide 12 experts, 3 and 6 not 8 ranks
    assert ep["micro_batches"] == 2
    two, four = ep["degrees"]
    assert two["message_bytes"] == four["message_bytes"] == 4 * MiB
    assert two["exchanges"] == 4 * 8 * 2
    assert two["bytes"] == 64 * 4 * MiB / 2 and four["bytes"] == 64 * 4 * MiB * 3 / 4
    assert two["seconds"] == pytest.approx(64 * 4 * MiB / 2 / 20e9)  # flat 20 GB/s at 2 ranks
    assert four["seconds"] == pytest.approx(64 * 4 * MiB * 3 / 4 / (40e9 * 4 / 64))  # 1/16 of 40 GB/s at 4 MiB
    assert ep["all_reduce_s"] == pytest.approx(4e8 * 2 * 7 / 8 / 100e9)
    reason = rec["reasons"]["expert_parallel"]
    assert "degree 4" in reason and "gradient all-reduce" in reason
    # a degree not measured takes the nearest rank count's curve, and says so
    assert comm.price_all_to_all(comm.all_to_all_points(rows), 8, 4 * MiB)[1].startswith("4-rank curve")
    assert "expert_parallel" not in comm.recommend([r for r in rows if r["op"] != "all_to_all"], model)
    unsplit = comm.recommend(rows, {**model, "num_experts": 7})
    assert unsplit["expert_parallel"]["degrees"] == [] and "no degree divides" in unsplit["reasons"]["expert_parallel"]


@pytest.mark.parametrize("argv, match", [
    (("--nproc", "1"), "at least 2 ranks"),
    (("--backend", "mpi"), "--backend"),
    (("--device", "tpu"), "--device"),
    (("--sizes", "lots"), "--sizes"),
    (("--repeats", "0"), "--repeats"),
    (("--nproc", "2", "--ranks", "3"), "--ranks"),
    (("--config", "/nonexistent.toml"), "no such file"),
])
def test_bad_options_are_config_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        comm.options_from_args(_args(*argv))


def test_nccl_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="(nccl|GPU)"):
        comm.options_from_args(_args("--backend", "nccl"))
    with pytest.raises(ConfigError, match="GPU"):
        comm.options_from_args(_args("--device", "cuda"))


def test_module_imports_no_torch_at_top_level():
    code = "import sys, zaya.tune.comm; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


# --- a real sweep ----------------------------------------------------------------------------------------------
def test_quick_sweep_two_gloo_ranks(tmp_path, monkeypatch, capsys):
    """2 spawned gloo ranks, --quick: positive bandwidth for every collective, a recommendation, the JSON, the PNG
    and the profile (in the tests' private $ZAYA_CACHE_DIR), which the next load_profile reads back."""
    monkeypatch.setattr(hwprofile, "_CACHE", {})
    monkeypatch.delenv(hwprofile.PROFILE_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cache = tmp_path / "cache"
    monkeypatch.setenv("ZAYA_CACHE_DIR", str(cache))
    assert comm.run(_args("--nproc", "2", "--quick", "--repeats", "2", "--json", "--out", str(tmp_path / "out"),
                          "--config", str(ROOT / "configs" / "tiny.toml"))) == 0
    result = json.loads(capsys.readouterr().out)
    ops = {r["op"] for r in result["rows"] if r.get("time_s")}
    assert set(comm.OPS) <= ops
    assert all(r["busbw_gbps"] > 0 and r["algbw_gbps"] > 0 for r in result["rows"] if r.get("time_s"))
    assert {r["ranks"] for r in result["rows"]} == {2}
    rec = result["recommendation"]
    assert 1.0 <= rec["ddp_bucket_mb"] <= 256.0
    assert {"ddp_bucket_mb", "zero1", "fsdp"} <= set(rec["reasons"])
    assert isinstance(rec["fsdp"]["reshard_after_forward"], bool)
    json_path, png_path = result["files"]
    assert json.loads(Path(json_path).read_text())["recommendation"] == rec
    assert Path(png_path).read_bytes()[:4] == b"\x89PNG"
    profile_file = Path(result["profile"])
    assert profile_file.is_file() and cache in profile_file.parents
    saved = hwprofile.read_profile(profile_file)
    assert saved.ddp_bucket_mb == rec["ddp_bucket_mb"]
    assert saved.fsdp_reshard_after_forward == rec["fsdp"]["reshard_after_forward"]
    assert saved.comm["backend"] == "gloo" and saved.comm["peak_busbw_gbps"]["all_reduce"]["2"] > 0
    # tiny.toml's 8 experts over the 2 ranks: degree 2, priced from the curve the planner reads back
    (two,) = rec["expert_parallel"]["degrees"]
    assert two["ep"] == 2 and two["seconds"] > 0 and "2-rank curve" in two["priced_from"]
    from zaya.tune.plan import profile_all_to_all

    assert [s for s, _ in profile_all_to_all(saved)[2]] == result["sizes"]
    report = comm.report(result)
    assert "bucket_cap_mb" in report and "reduce_scatter" in report and "expert parallel: " in report


def _wrap_rank(rank: int, world: int, mode: str) -> dict:
    import torch
    from torch import nn

    from zaya.distributed.parallel import wrap
    from zaya.distributed.runtime import start

    rt = start(device="cpu")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    parallel = wrap(Net(), mode, rt)
    out = {"settings": parallel.settings, "describe": parallel.describe()}
    if mode == "ddp":
        out["bucket_bytes_cap"] = parallel.wrapped.bucket_bytes_cap
    return out


def _wrap_with_profile(rank: int, world: int, path: str) -> dict:
    """One rank: wrap for ddp and for fsdp with ``$ZAYA_HARDWARE_PROFILE=path``; what each wrapper was given."""
    os.environ[hwprofile.PROFILE_ENV] = str(path)
    hwprofile._CACHE.clear()
    return {mode: _wrap_rank(rank, world, mode) for mode in ("ddp", "fsdp")}


def test_wrap_takes_the_profile_settings(tmp_path):
    """wrap() under a 2-rank gloo group hands the profile's bucket size to DDP and its reshard choice to FSDP2."""
    path = tmp_path / "profile.json"
    prof = hwprofile.HardwareProfile(device_key="test", ddp_bucket_mb=3.5, fsdp_reshard_after_forward=False)
    path.write_text(prof.to_json())
    values = run_ok(_wrap_with_profile, 2, str(path), timeout_s=120)
    for mode, value in values[0].items():
        assert str(path) in value["settings"]["source"] and str(path) in value["describe"]
        if mode == "ddp":
            assert value["bucket_bytes_cap"] == int(3.5 * MiB)
            assert value["settings"]["bucket_cap_mb"] == 3.5 and "bucket_cap_mb 3.5" in value["describe"]
        else:
            assert value["settings"]["reshard_after_forward"] is False


def test_cli_rejects_one_rank(capsys):
    """The command (its main, in this process: `zaya` subprocesses would only add torch start-ups): a bad option is
    a ConfigError's exit code and message, before any rank starts; --help names the option."""
    from zaya.cli import main
    from zaya.core.errors import exit_code_of

    assert main(["tune", "comm", "--nproc", "1"]) == exit_code_of(ConfigError("x")) != 0
    assert "at least 2 ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["tune", "comm", "--help"])
    assert done.value.code == 0 and "--nproc" in capsys.readouterr().out


def _sweep_without_tensor_collectives(rank: int, world: int):
    """measure() on a gloo group whose tensor all-gather / reduce-scatter and list reduce-scatter 'do not exist'."""
    import torch
    import torch.distributed as dist

    from zaya.distributed.runtime import start

    def missing(*args, **kwargs):
        raise RuntimeError("not supported by this backend")

    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
                 "reduce_scatter"):
        setattr(dist, name, missing)
    rt = start(device="cpu")
    opts = comm.Options(nproc=2, sizes=[4096], ranks=[2], repeats=1, warmup=0)
    rows = comm.measure(opts, rt.rank, world, world, torch.device("cpu"))
    return rows, comm.table(rows)


def test_missing_collectives_are_measured_through_stand_ins():
    rows, text = run_ok(_sweep_without_tensor_collectives, 2, timeout_s=120)[0]
    assert {r["op"]: r["impl"] for r in rows} == {
        "all_reduce": "all_reduce", "all_gather": "all_gather (list)", "reduce_scatter": "all_reduce + slice",
        "all_to_all": "all_to_all_single", "broadcast": "broadcast"}
    assert all(r["busbw_gbps"] > 0 for r in rows)
    assert "reduce_scatter (bus GB/s, time per call)  [measured as all_reduce + slice]" in text
    notes = comm.recommend(rows)["notes"]
    assert any("all_gather into a list" in n for n in notes) and any("lower bound" in n for n in notes)


def _ddp_bucket_and_fsdp_forward(rank: int, world: int) -> dict:
    """DDP under the cached profile (no $ZAYA_HARDWARE_PROFILE), then whether an FSDP2 block stays gathered after a
    forward under a profile that says reshard_after_forward = False."""
    import torch
    from torch.distributed.tensor import DTensor

    out = _wrap_rank(rank, world, "ddp")
    os.environ[hwprofile.PROFILE_ENV] = os.environ["FSDP_PROFILE"]
    hwprofile._CACHE.clear()
    from zaya.distributed.parallel import wrap
    from zaya.distributed.runtime import start

    rt = start(device="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model.blocks = list(model)  # wrap() shards each of model.blocks
    fsdp = wrap(model, "fsdp", rt)
    fsdp.wrapped(torch.ones(2, 8, device="cpu"))
    out["block_sharded_after_forward"] = isinstance(model[0].weight, DTensor)
    return out


def test_the_swept_profile_is_what_the_trainers_ranks_read(tmp_path, monkeypatch):
    """The profile written by the sweep's ranks (one thread each) has the key that torchrun-like ranks (one thread
    each) look up: DDP gets its bucket without $ZAYA_HARDWARE_PROFILE; FSDP2 really keeps blocks gathered."""
    monkeypatch.setattr(hwprofile, "_CACHE", {})
    monkeypatch.delenv(hwprofile.PROFILE_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ZAYA_CACHE_DIR", str(tmp_path / "cache"))
    assert comm.run(_args("--nproc", "2", "--quick", "--sizes", "4K,64K", "--repeats", "1", "--json", "--no-plot",
                          "--out", str(tmp_path / "out"))) == 0
    saved = hwprofile.read_profile(next((tmp_path / "cache" / "hardware").glob("*.json")))
    assert saved.ddp_bucket_mb == 1.0  # 64 KiB at most, kept within [1, 256] MiB
    fsdp_profile = tmp_path / "fsdp.json"
    fsdp_profile.write_text(hwprofile.HardwareProfile(fsdp_reshard_after_forward=False).to_json())
    for value in run_ok(_ddp_bucket_and_fsdp_forward, 2, env={"FSDP_PROFILE": str(fsdp_profile)}, timeout_s=120):
        assert value["bucket_bytes_cap"] == 1 * MiB and saved.path in value["describe"]
        assert value["block_sharded_after_forward"] is False
