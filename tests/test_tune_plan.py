"""``zaya plan``: the live-memory counter, the fake-tensor activation trace (against real runs of the same code),
its extrapolation in depth and tokens, the memory model's parts, the stage schedule, communication, the CLI, and
the validation that matters: the estimate within 15 % of the measured peak of real 2-rank CPU training runs at three
shapes under ZeRO-1 and FSDP2 (benchmarks/planner_validation.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from zaya.config import load_config
from zaya.core.errors import ConfigError
from zaya.tune import plan
from zaya.tune.activation_trace import activation_model, trace_micro_batch
from zaya.tune.live_memory import LiveMemory

from dist_helpers import run_ok

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import planner_validation as pv  # noqa: E402 (after the path)

SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_query_heads=2", "model.num_kv_heads=2",
         "model.head_dim=32", "model.num_experts=4", "model.expert_hidden_size=128", "model.router_hidden_size=32",
         "model.vocab_size=512", "model.max_seq_len=64", "train.seq_len=64"]


def _small(*extra: str):
    return load_config(ROOT / "configs" / "tiny.toml", SMALL + list(extra))


# --- LiveMemory ----------------------------------------------------------------------------------------------------
def test_live_memory_counts_allocations_views_frees_and_resizes():
    with LiveMemory("cpu") as mem:
        x = torch.empty(1000, 250)  # 1,000,000 bytes
        assert mem.current == 1_000_000
        v = x[:10].t()  # a view: no new memory
        assert mem.current == 1_000_000
        del x
        assert mem.current == 1_000_000  # the view keeps the storage alive
        del v
        assert mem.current == 0
        y = torch.ones(100)
        y.untyped_storage().resize_(0)  # how FSDP2 frees its gathered parameters
        assert mem.current == 0
        y.untyped_storage().resize_(800)
        assert mem.current == 800
        assert mem.peak == 1_000_000
        mem.reset_peak()
        assert mem.peak == 800


def test_live_memory_ignores_views_of_tensors_made_before_it():
    w = torch.randn(256, 256)
    with LiveMemory("cpu") as mem:
        _ = w.t()
        _ = w[:3]
        assert mem.current == 0
        out = w @ w  # new memory
        assert mem.current == out.untyped_storage().nbytes()


def test_trace_equals_the_same_step_counted_on_real_tensors():
    """The fake-tensor trace runs the model's own code: its bytes are those of a real forward + backward."""
    cfg = _small().model
    torch.manual_seed(0)
    model = __import__("zaya.model", fromlist=["ZayaForCausalLM"]).ZayaForCausalLM(cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(3, cfg.vocab_size, (3, 48))
    with LiveMemory("cpu") as mem:
        out = model(ids, labels=ids)
        loss = out.loss
        del out
        saved = mem.current
        loss.backward()
        del loss
        peak = mem.peak
    traced = trace_micro_batch(cfg, 3, 48, dtype="float32")
    assert traced.saved == saved
    assert traced.peak == peak


@pytest.mark.parametrize("dtype,ac", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_activation_model_extrapolates_to_depth_and_tokens(dtype, ac):
    """Fitted on 1-2 layers and 1-2 sequences of 64 tokens; checked against a full trace of 5 layers x 6 x 64.
    Tolerance 5 %: every phase is linear in layers and tokens up to small per-shape constants."""
    cfg = _small().model
    am = activation_model(cfg, 64, dtype=dtype, activation_checkpointing=ac)
    full = trace_micro_batch(dataclasses.replace(cfg, num_layers=5), 6, 64, dtype=dtype, activation_checkpointing=ac)
    assert am.saved_bytes(5, 6 * 64) == pytest.approx(full.saved, rel=0.05)
    assert am.peak_bytes(5, 6 * 64) == pytest.approx(full.peak, rel=0.05)


def test_activation_checkpointing_keeps_less():
    cfg = _small().model
    plain = activation_model(cfg, 64, dtype="float32")
    checkpointed = activation_model(cfg, 64, dtype="float32", activation_checkpointing=True)
    assert checkpointed.saved_bytes(8, 1024) < 0.5 * plain.saved_bytes(8, 1024)


# --- the memory model ------------------------------------------------------------------------------------------------
def test_persistent_memory_by_mode():
    config = _small()
    sizes = plan.model_sizes(config, 4)
    assert sizes.total == sizes.muon + sizes.adamw
    ddp = plan.persistent_bytes(sizes, "ddp", 4)
    assert ddp["weights"] == ddp["gradients"] == 4 * sizes.total
    assert ddp["optimizer"] == 4 * sizes.muon + 8 * sizes.adamw
    zero1 = plan.persistent_bytes(sizes, "zero1", 4)
    assert zero1["weights"] == ddp["weights"] and zero1["optimizer"] < ddp["optimizer"]
    assert zero1["optimizer"] >= ddp["optimizer"] / 4  # the heaviest owner holds at least an even share
    fsdp = plan.persistent_bytes(sizes, "fsdp", 4)
    assert fsdp["weights"] == 4 * math.ceil(sizes.total / 4)
    assert fsdp["gradients"] == 0  # dropped between steps


def test_memory_plan_largest_micro_batch_fits_and_one_more_does_not():
    config = _small()
    budget = 64 * 2 ** 20
    for mode in plan.MODES:
        m = plan.memory_plan(config, gpus=2, parallel=mode, micro_batch=1, seq_len=64, budget_bytes=budget,
                             device_type="cpu")
        best = m["max_micro_batch"]
        assert best >= 1, mode
        fits = plan.memory_plan(config, gpus=2, parallel=mode, micro_batch=best, seq_len=64, device_type="cpu")
        over = plan.memory_plan(config, gpus=2, parallel=mode, micro_batch=best + 1, seq_len=64, device_type="cpu")
        assert fits["forward_backward"] <= budget < over["forward_backward"], mode


def test_fsdp_and_context_parallel_lower_the_per_gpu_memory():
    config = _small("model.max_seq_len=256", "train.seq_len=256")
    base = plan.memory_plan(config, gpus=4, parallel="ddp", micro_batch=2, seq_len=256)
    assert plan.memory_plan(config, gpus=4, parallel="fsdp", micro_batch=2, seq_len=256)["persistent"] < \
        base["persistent"]
    cp2 = plan.memory_plan(config, gpus=4, parallel="ddp", micro_batch=2, seq_len=256, cp=2)
    assert cp2["activations"] < base["activations"]
    with pytest.raises(ConfigError, match="multiple of context parallel"):
        plan.memory_plan(config, gpus=3, parallel="ddp", micro_batch=1, seq_len=256, cp=2)


def test_stage_shapes_of_zaya1_base():
    config = load_config(ROOT / "configs" / "zaya1-base.toml")
    stages = plan.stage_shapes(config, 1024, last_stage_tokens=1_200_000_000_000)
    assert [s.name for s in stages] == ["web-4k", "code-math-4k", "long-32k"]
    assert [s.tokens for s in stages] == [8e12, 4e12, 1.2e12]
    assert [s.cp for s in stages] == [1, 1, 2]
    assert stages[0].global_batch_tokens == 4_194_304  # the ramp's first point
    assert stages[2].global_batch_tokens == 33_554_432  # the 32k stage's batch
    assert stages[2].seq_len == 32768 and stages[2].tokens_note == "--last-stage-tokens"


def test_communication_is_hierarchical_across_nodes():
    sizes = plan.model_sizes(_small(), 16)
    grads = 4 * sizes.total
    inside = plan.comm_bytes_per_step(sizes, "ddp", 8, 2, True, gpus_per_node=8)
    assert inside["all_reduce_gradients"] == pytest.approx(2 * 7 / 8 * grads)
    across = plan.comm_bytes_per_step(sizes, "ddp", 16, 2, True, gpus_per_node=8)  # 2 nodes: half a share
    assert across["all_reduce_gradients"] == pytest.approx(2 * grads / 8 * 0.5)
    fsdp = plan.comm_bytes_per_step(sizes, "fsdp", 8, 2, False, gpus_per_node=8)
    assert fsdp["all_gather_parameters"] == pytest.approx(7 / 8 * 2 * sizes.total)
    assert plan.comm_bytes_per_step(sizes, "ddp", 1, 2, True, gpus_per_node=8) == {}


def test_expert_parallelism_splits_the_experts_and_sends_the_tokens():
    """ep = 2: a rank holds half the experts' weights, gradients and (ddp) Muon state; the plan counts the
    all-to-all: four exchanges per MoE layer of the (ep - 1) / ep of the routed rows that leave the rank."""
    sizes = plan.model_sizes(_small(), 4)
    assert 0 < sizes.experts < sizes.muon
    whole, split = plan.persistent_bytes(sizes, "ddp", 4), plan.persistent_bytes(sizes, "ddp", 4, ep=2)
    half = 4 * (sizes.experts // 2)
    for part in ("weights", "gradients", "optimizer"):
        assert whole[part] - split[part] == half, part
    config = _small("train.expert_parallel=2")
    mc = config.model
    assert plan.all_to_all_bytes_per_step(config, 1000, 2, 2) == 4 * mc.num_layers * 1000 * mc.top_k * 64 * 2 / 2
    assert plan.all_to_all_bytes_per_step(config, 1000, 1, 2) == 0
    hw = plan.Hardware(gpus=4, gpu_memory_gib=80, tflops=900, net_gbps=400)
    stage = plan.plan(config, hw, modes=("ddp",), ac_options=(False,))["stages"][0]
    assert stage["memory"][0]["ep"] == 2 and stage["memory"][0]["weights"] == split["weights"]
    assert stage["communication"]["ddp"]["all_to_all_tokens"] == plan.all_to_all_bytes_per_step(
        config, stage["global_batch_tokens"] / 4, 2, 2)
    with pytest.raises(ConfigError, match="not a multiple of train.expert_parallel = 2"):
        plan.plan(config, dataclasses.replace(hw, gpus=3), modes=("ddp",), ac_options=(False,))


# --- the expert-parallel degree ---------------------------------------------------------------------------------------
HEAVY = ["model.num_experts=8", "model.expert_hidden_size=1024", "train.dtype=float32", "train.parallel=zero1"]


@pytest.fixture(scope="module")
def heavy_plan():
    """The heavy-expert model's plan on 4 GPUs with room for everything: (config, hardware, its ep rows by degree)."""
    config = _small(*HEAVY)
    hw = plan.Hardware(gpus=4, gpu_memory_gib=80, tflops=0.5, net_gbps=400)  # a step of ~0.1 s
    ep = plan.plan(config, hw, modes=("zero1",), ac_options=(False,))["stages"][0]["expert_parallel"]
    return config, hw, {r["ep"]: r for r in ep["degrees"]}


def _ep_plan(config, hw):
    return plan.plan(config, hw, modes=("zero1",), ac_options=(False,))["stages"][0]["expert_parallel"]


def _memory_between(low: float, high: float) -> float:
    """GPU memory in GiB whose budget (10 % headroom) lies halfway between two peaks."""
    return (low + high) / 2 / 0.9 / plan.GIB


def test_expert_parallel_degree_smallest_that_fits(heavy_plan):
    """Experts that fit one GPU: degree 1; ones that do not: the smallest degree whose peak fits; none fits: no
    degree, and the reason names the largest one's peak."""
    config, hw, rows = heavy_plan
    assert sorted(rows) == [1, 2, 4]  # the divisors of 8 experts and 4 GPUs
    assert rows[1]["peak"] > rows[2]["peak"] > rows[4]["peak"]  # each rank holds fewer experts
    assert rows[1]["all_to_all_bytes"] == 0 < rows[2]["all_to_all_bytes"] < rows[4]["all_to_all_bytes"]
    assert _ep_plan(config, hw)["recommended"] == 1
    tight = dataclasses.replace(hw, gpu_memory_gib=_memory_between(rows[2]["peak"], rows[1]["peak"]))
    tight = _ep_plan(config, tight)
    assert tight["recommended"] == 2 and not tight["degrees"][0]["fits"]
    tighter = dataclasses.replace(hw, gpu_memory_gib=_memory_between(rows[4]["peak"], rows[2]["peak"]))
    assert _ep_plan(config, tighter)["recommended"] == 4
    small = _ep_plan(config, dataclasses.replace(hw, gpu_memory_gib=rows[4]["peak"] / 2 / plan.GIB))
    assert small["recommended"] is None and "no degree dividing 8 experts and 4 GPUs fits" in small["reason"]
    odd = _ep_plan(config, dataclasses.replace(hw, gpus=3, gpu_memory_gib=_memory_between(rows[2]["peak"],
                                                                                            rows[1]["peak"])))
    assert [r["ep"] for r in odd["degrees"]] == [1] and odd["recommended"] is None
    fsdp = _ep_plan(_small(*HEAVY, "train.parallel=fsdp"), hw)  # FSDP2 shards the experts already
    assert [r["ep"] for r in fsdp["degrees"]] == [1] and "under fsdp degree 1 alone" in fsdp["reason"]


def test_expert_parallel_share_bound_and_pricing(heavy_plan, tmp_path):
    """The all-to-all is priced at --net-gbps, or from a profile's measured curve at one exchange's message size;
    a degree whose all-to-all passes the bound is not recommended."""
    from zaya.core.hardware import read_profile

    config, hw, rows = heavy_plan
    hw = dataclasses.replace(hw, gpu_memory_gib=_memory_between(rows[2]["peak"], rows[1]["peak"]))
    step_s = plan.plan(config, hw, modes=("zero1",), ac_options=(False,))["stages"][0]["step_seconds"]
    two = _ep_plan(config, hw)["degrees"][1]
    assert two["all_to_all_seconds"] == pytest.approx(two["all_to_all_bytes"] / (400e9 / 8))
    assert two["share_of_step"] == pytest.approx(two["all_to_all_seconds"] / step_s)
    assert "--net-gbps 400" in two["priced_from"]
    slow = _ep_plan(config, dataclasses.replace(hw, net_gbps=two["all_to_all_bytes"] * 8 / 1e9 / step_s))  # 100 %
    assert slow["recommended"] is None and "over the 25% bound" in slow["reason"]
    unpriced = _ep_plan(config, dataclasses.replace(hw, net_gbps=None))
    assert unpriced["recommended"] == 2 and "not priced" in unpriced["reason"]
    # a measured curve: 10 GB/s below 1 MiB, 40 GB/s from 64 MiB, at 2 ranks only
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"version": 1, "comm": {"all_to_all_busbw_gbps": {
        "2": [[1 << 20, 10.0], [64 << 20, 40.0]]}}}))
    curves = plan.profile_all_to_all(read_profile(path))
    measured = _ep_plan(config, dataclasses.replace(hw, all_to_all_busbw=curves, profile=str(path)))
    two = measured["degrees"][1]
    message = two["all_to_all_message_bytes"]
    assert message < 1 << 20  # the small model's exchanges are below the curve: its first point
    per = message * (2 - 1) / 2 / 10e9
    assert two["all_to_all_seconds"] == pytest.approx(two["all_to_all_bytes"] / message * 2 * per)
    assert str(path) in two["priced_from"] and "2-rank curve" in two["priced_from"]
    assert "4 ranks not measured" in measured["degrees"][2]["priced_from"]
    path.write_text(json.dumps({"version": 1, "comm": {"all_to_all_busbw_gbps": {"2": [[1024, 0]]}}}))
    with pytest.raises(ConfigError, match="all_to_all_busbw_gbps"):
        plan.profile_all_to_all(read_profile(path))


def test_mfu_from_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps({"step": i, "mfu": v}) for i, v in enumerate([0.9, 0.3, 0.4, 0.5]))
                    + "\n{\"kind\": \"eval\"}\nnot json\n")
    assert plan.mfu_from_metrics(path) == pytest.approx(0.4)  # the first record (warm-up) is skipped
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no train records"):
        plan.mfu_from_metrics(tmp_path / "empty.jsonl")


# --- the command -----------------------------------------------------------------------------------------------------
def test_cli_plan_json_and_table(tmp_path, capsys):
    """Through main in this process (a `zaya` subprocess would only add a torch start-up): stdout is the JSON."""
    from zaya.cli import main

    config = tmp_path / "c.toml"
    config.write_text((ROOT / "configs" / "tiny.toml").read_text())
    code = main(["plan", "--config", str(config), "--gpus", "2", "--gpu-memory", "1", "--tflops", "0.07",
                 "--net-gbps", "10", "--storage-gbps", "8", "--set", "model.num_layers=2",
                 "--set", 'train.dtype="float32"', "--json", "--parallel", "zero1", "--parallel", "fsdp"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    result = json.loads(printed.out)
    (stage,) = result["stages"]
    assert [(m["parallel"], m["activation_checkpointing"]) for m in stage["memory"]] == [
        ("zero1", False), ("zero1", True), ("fsdp", False), ("fsdp", True)]
    for row in stage["memory"]:
        assert row["fits"] and row["max_micro_batch"] >= 16
        assert row["peak"] == max(row["forward_backward"], row["optimizer_step"])
    assert stage["tokens_per_s"] == pytest.approx(2 * 0.07e12 * 0.35 / stage["train_flops_per_token"])
    assert result["checkpoint"]["write_seconds"] == pytest.approx(result["checkpoint"]["bytes"] / 1e9)
    table = plan.report(result, str(config))
    assert "fsdp  cp1 ac on" in table and "max micro-batch" in table and "checkpoint:" in table
    assert stage["expert_parallel"]["recommended"] == 1 and "recommended train.expert_parallel = 1" in table


@pytest.mark.parametrize("argv,needle", [
    (["--config", "missing.toml", "--tflops", "1"], "missing.toml"),
    (["--tflops", "0"], "--tflops"),
    (["--tflops", "1", "--mfu", "nope.jsonl"], "nope.jsonl"),
    (["--tflops", "1", "--context-parallel", "two"], "--context-parallel"),
    (["--tflops", "1", "--headroom", "1.5"], "--headroom"),
    (["--tflops", "1", "--hardware-profile", "none.json"], "--hardware-profile none.json: no such file"),
])
def test_cli_plan_errors(argv, needle, tmp_path, monkeypatch, capsys):
    from zaya.cli import main

    monkeypatch.chdir(tmp_path)
    base = ["plan", "--gpus", "2", "--gpu-memory", "1"]
    if "--config" not in argv:
        base += ["--config", str(ROOT / "configs" / "tiny.toml")]
    assert main(base + argv) == 2
    assert needle in capsys.readouterr().err


# --- validation against real runs ------------------------------------------------------------------------------------
# Each shape under one wrapper by default (one launch of 2 ranks, about 25 s); every shape under both is the slow
# variant. The modes differ in the persistent state only (replicated vs sharded parameters, gradients and moments),
# which both modes still cover, on different shapes.
@pytest.mark.parametrize("pairs", [
    [("tiny", "zero1"), ("wide", "fsdp"), ("deep", "zero1")],
    pytest.param([(s, m) for s in pv.SHAPES for m in ("zero1", "fsdp")], marks=pytest.mark.slow),
], ids=["each-shape", "every-shape-and-mode"])
def test_estimate_within_15_percent_of_measured_peaks(pairs, tmp_path, shakespeare_dataset):
    """Shapes x (ZeRO-1, FSDP2), fp32, real Trainer steps on 2 gloo ranks."""
    assert {s for s, _ in pairs} == set(pv.SHAPES)
    cases = [case for shape, mode in pairs
             for case in pv.build_cases([shape], [mode], "float32", str(tmp_path), str(shakespeare_dataset))]
    rows = pv.validate(cases, launch=run_ok)
    assert len(rows) == len(pairs)
    for row in rows:
        assert abs(row["ratio"] - 1) <= 0.15, (row["case"], row["ratio"], row["measured"], row["estimated"])


def test_single_process_estimate_within_15_percent(tmp_path, shakespeare_dataset):
    """One process runs without a wrapper (gradients dropped after each step): the planner's gpus = 1 case."""
    (row,) = pv.validate(pv.build_cases(["tiny"], ["ddp"], "float32", str(tmp_path), str(shakespeare_dataset)),
                         world=1, launch=run_ok)
    assert row["estimated"]["persistent"] < row["measured"]["forward_backward"]
    assert abs(row["ratio"] - 1) <= 0.15, row
