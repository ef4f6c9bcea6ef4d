"""Expert parallelism through the trainer on gloo ranks: per-step losses with train.expert_parallel = N equal those
of the same ranks without it (the ZAYA1 router with and without the skip class, the linear router; DDP, ZeRO-1 and
FSDP2; 2 and 4 ranks; from random weights and through train.init_from), each rank holds 1/N of the experts and of
their optimizer state, a checkpoint saved at one degree resumes at another and at none with the same next losses,
the CLI runs it, the config refuses what cannot work, and a lost or hung peer in any of a layer's exchanges is a
CollectiveError naming the layer, the exchange and the ranks.

fp32 throughout; losses are compared to 1e-5 relative (the targets' tolerance): the expert-parallel run computes the
same products, but sums each expert's weight gradient over rows from several ranks in another order, and the gradient
norm in two parts (seen: a few 1e-7 after 20 steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import MICRO_CONFIG
from dist_helpers import free_port, run_ok, run_ranks, strict_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROUTERS = {
    "zaya+skip": {"router": "zaya", "router_skip_expert": True, "router_skip_bias_init": 0.0},  # tokens take it
    "zaya": {"router": "zaya", "router_skip_expert": False},
    "linear": {"router": "linear"},
}


def micro(dataset, run_dir, steps: int, **tables):
    """The micro config in fp32 for ``steps`` steps, each table updated from ``tables``; ``model=None``: no model
    table (``train.init_from`` gives the model)."""
    from zaya.config import config_from_dict

    data = tomllib.loads(MICRO_CONFIG.format(dataset=dataset, run_dir=run_dir))
    if "model" in tables and tables["model"] is None:
        del data["model"], tables["model"]
    data["train"].update({"dtype": "float32", "eval_every": 0, "sample_tokens": 0, "max_steps": steps,
                          "router_probe": False})
    data["optim"]["muon_ns_dtype"] = "float32"
    data["checkpoint"].update({"every": 0, "ram_tier": False})
    for table, values in tables.items():
        data.setdefault(table, {}).update(values)
    return config_from_dict(data, "micro")


def losses(run_dir, key: str = "loss") -> list[float]:
    """Per-step ``key`` (the loss; or the gradient norm, which also sees a wrong scale of the expert gradients that
    Muon's orthogonalised updates would hide from the losses)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if r.get("kind") == "train"]


def _expert_bytes(trainer) -> dict:
    """This rank's bytes of expert weights and of their optimizer state (the tensors' own bytes: an FSDP2 DTensor's
    local shard), and its expert tensors."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    named = {n: p for n, p in trainer.parallel.model.named_parameters() if ".experts." in n}
    ids = {id(p) for p in named.values()}
    state = [local(t) for opt in trainer.optimizers for p, s in opt.state.items() if id(p) in ids
             for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"weights": sum(local(p).numel() * p.element_size() for p in named.values()),
            "state": sum(t.numel() * t.element_size() for t in state),
            "shards": {n: local(p).detach().clone() for n, p in named.items()}}


def _train(rank: int, world: int, dataset: str, run_dir: str, steps: int, tables: dict) -> dict:
    from zaya.train.callbacks import Callback
    from zaya.train.trainer import train

    class Measure(Callback):
        def on_start(self, trainer) -> None:
            self.at_start = _expert_bytes(trainer)["shards"]

        def on_stop(self, trainer, summary) -> None:
            summary["expert_bytes"] = {**_expert_bytes(trainer), "at_start": self.at_start}

    return train(micro(dataset, run_dir, steps, **tables), callbacks=[Measure()]).get("expert_bytes")


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


def _run(dataset, run_dir, world: int, steps: int, ep: int, parallel: str, router: str, **extra) -> list[dict]:
    tables = {"train": {"expert_parallel": ep, "parallel": parallel, **extra.pop("train", {})},
              "model": ROUTERS[router], **extra}
    return run_ok(_train, world, str(dataset), str(run_dir), steps, tables)


@pytest.fixture(scope="module")
def zero1_skip_base(shakespeare_dataset, tmp_path_factory):
    """Three steps on 2 ranks without expert parallelism (ZeRO-1, ZAYA1 router with the skip class): losses."""
    run = tmp_path_factory.mktemp("base")
    _run(shakespeare_dataset, run, 2, 3, 1, "zero1", "zaya+skip")
    return {key: losses(run, key) for key in ("loss", "grad_norm")}


def test_zero1_losses_memory_checkpoint_and_export_at_degree_2(tmp_path, shakespeare_dataset, zero1_skip_base):
    """Steps 1-2 at ep = 2 on 2 ranks: the losses and gradient norms of ep = 1, each rank 1/2 of the expert weights
    and their state; the step-2 checkpoint exports the whole experts (exactly the ranks' shards, concatenated) and
    resumes at ep = 1 for step 3 with the loss of the run without ep."""
    from safetensors.torch import load_file

    from zaya.checkpoint.export import export

    sharded = _run(shakespeare_dataset, tmp_path, 2, 2, 2, "zero1", "zaya+skip")
    for key, want in zero1_skip_base.items():
        assert _close(losses(tmp_path, key), want[:2]), (key, losses(tmp_path, key), want)
    for part in sharded:  # no replicas: each rank owns its shards and their state
        assert part["state"] == part["weights"] > 0
    assert sharded[0]["weights"] == sharded[1]["weights"]
    out = export(tmp_path / "checkpoints" / "step-00000002", tmp_path / "export", format="safetensors")
    exported = {}
    for file in out.glob("*.safetensors"):
        exported.update(load_file(file))
    for name in sharded[0]["shards"]:
        assert torch.equal(exported[name], torch.cat([r["shards"][name] for r in sharded])), name
    _run(shakespeare_dataset, tmp_path, 2, 3, 1, "zero1", "zaya+skip")
    assert _close(losses(tmp_path), zero1_skip_base["loss"]), (losses(tmp_path), zero1_skip_base)


@pytest.mark.parametrize("world,ep,parallel,router,steps,recompute", [
    (2, 2, "ddp", "linear", 3, True),
    pytest.param(2, 2, "ddp", "zaya", 20, False, marks=pytest.mark.slow),
    pytest.param(2, 2, "zero1", "zaya+skip", 20, False, marks=pytest.mark.slow),
    pytest.param(2, 2, "ddp", "linear", 20, False, marks=pytest.mark.slow),
    pytest.param(4, 2, "zero1", "zaya+skip", 20, False, marks=pytest.mark.slow),
    pytest.param(4, 4, "ddp", "zaya", 20, False, marks=pytest.mark.slow),
    pytest.param(4, 4, "zero1", "linear", 20, False, marks=pytest.mark.slow),
])
def test_losses_and_memory_with_expert_parallelism_equal_those_without(tmp_path, shakespeare_dataset, world, ep,
                                                                       parallel, router, steps, recompute):
    """``recompute``: with activation checkpointing in the ep run (the recomputed forward exchanges again)."""
    base = _run(shakespeare_dataset, tmp_path / "base", world, steps, 1, parallel, router)
    sharded = _run(shakespeare_dataset, tmp_path / "ep", world, steps, ep, parallel, router,
                   train={"activation_checkpointing": recompute})
    for key in ("loss", "grad_norm"):
        want, got = losses(tmp_path / "base", key), losses(tmp_path / "ep", key)
        assert len(got) == steps and _close(got, want), (key, got, want)
    whole = base[0]["weights"]
    for part in sharded:  # 1/ep of the expert weights
        assert part["weights"] * ep == whole > 0
    # Muon's state (one momentum buffer per shard): under DDP each rank's of its shards; under ZeRO-1 the replicas of
    # a slice split it, so that all ranks together hold it once.
    if parallel == "ddp":
        assert all(part["state"] == part["weights"] for part in sharded)
    else:
        assert sum(part["state"] for part in sharded) == whole and all(part["state"] > 0 for part in sharded)


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> Path:
    """A random transformers ``ZayaForCausalLM`` with 4 experts, for the shakespeare tokenizer's 512 ids, saved in
    shards with an index."""
    from transformers import ZayaConfig, ZayaForCausalLM

    torch.manual_seed(0)
    config = ZayaConfig(vocab_size=512, hidden_size=40, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, num_experts=4, moe_intermediate_size=24,
                        router_hidden_size=12, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
    out = tmp_path_factory.mktemp("hf") / "hf"
    ZayaForCausalLM(config).save_pretrained(out, max_shard_size="20KB")
    return out


@pytest.mark.slow  # the fast FSDP2 test below starts from the transformers-made weights at degree 2 too
@pytest.mark.parametrize("source", ["hf_source", "micro_run"])
def test_init_from_at_degree_2(tmp_path, shakespeare_dataset, request, source):
    """Two steps on 2 ranks (ddp) at ep = 2 from transformers-made weights, or from a zaya run's training checkpoint
    (read through DCP's planner): the losses and norms of ep = 1, each rank holding half of the experts, filled with
    its slice of the source's (those of ep = 1, which test_init_from compares with the source)."""
    path = str(request.getfixturevalue(source))
    runs = {}
    for ep in (1, 2):
        runs[ep] = _run(shakespeare_dataset, tmp_path / str(ep), 2, 2, ep, "ddp", "zaya", model=None,
                        train={"init_from": path, "max_steps": 2})
    for key in ("loss", "grad_norm"):
        want, got = losses(tmp_path / "1", key), losses(tmp_path / "2", key)
        assert len(got) == 2 and _close(got, want), (key, got, want)
    assert all(part["weights"] * 2 == runs[1][0]["weights"] for part in runs[2])
    assert any(".experts." in n for n in runs[2][0]["at_start"])
    for name in runs[2][0]["at_start"]:
        whole = torch.cat([r["at_start"][name] for r in runs[2]])
        assert torch.equal(whole, runs[1][0]["at_start"][name]), name


def test_zaya_train_with_expert_parallel_2_on_two_gloo_ranks(tmp_path, micro_config):
    """``zaya train`` under torchrun's environment (two processes by hand: RANK, WORLD_SIZE, MASTER_*)."""
    config = micro_config(extra="")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "PATH": "/usr/bin:/bin"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "zaya.cli", "train", "--config", str(config), "--set", "train.expert_parallel=2",
             "--set", "train.max_steps=2", "--set", "train.device=cpu", "--set", "train.dtype=float32",
             "--set", "checkpoint.ram_tier=false"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert "expert parallel 2" in outs[0], outs[0]
    assert len(losses(tmp_path / "run")) == 2


def test_a_degree_that_does_not_divide_the_experts_is_a_config_error(tmp_path, shakespeare_dataset):
    from zaya.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.expert_parallel = 3 does not divide model.num_experts = 4.*"
                                          r"one of \[1, 2, 4\]"):
        micro(shakespeare_dataset, tmp_path, 1, train={"expert_parallel": 3})


@pytest.mark.parametrize("world,init", [(2, True), pytest.param(4, False, marks=pytest.mark.slow)])
def test_fsdp_with_expert_parallelism_and_its_checkpoint_resumed_under_zero1_at_degree_1(tmp_path, shakespeare_dataset,
                                                                                       hf_source, world, init):
    """FSDP2 for the other parameters, the experts at degree 2 outside it: steps 1-2 have the losses and norms of
    FSDP2 without ep, each rank holds half of the experts (and, Muon's being split over replicas as under ddp, the
    whole state of its shards); the step-2 checkpoint exports the whole experts and resumes under ZeRO-1 at degree 1
    with the step-3 loss of FSDP2 without ep. ``init``: every run starts from the transformers-made weights
    (train.init_from; at degree 2 each rank reads only its experts, under FSDP2 only its shards of the rest)."""
    from safetensors.torch import load_file

    from zaya.checkpoint.export import export

    def run(name: str, steps: int, ep: int, parallel: str) -> list[dict]:
        source = {"model": None, "train": {"init_from": str(hf_source)}} if init else {}
        return _run(shakespeare_dataset, tmp_path / name, world, steps, ep, parallel, "zaya+skip", **source)

    base = run("base", 3, 1, "fsdp")
    sharded = run("ep", 2, 2, "fsdp")
    for key in ("loss", "grad_norm"):
        want, got = losses(tmp_path / "base", key), losses(tmp_path / "ep", key)
        assert _close(got, want[:2]), (key, got, want)
    whole = base[0]["weights"] * world  # FSDP2 shards the experts too without ep: each rank 1/world
    for part in sharded:
        assert part["weights"] * 2 == whole and part["state"] == part["weights"]
    out = export(tmp_path / "ep" / "checkpoints" / "step-00000002", tmp_path / "export", format="safetensors")
    exported = {k: v for file in out.glob("*.safetensors") for k, v in load_file(file).items()}
    for name in sharded[0]["shards"]:
        assert torch.equal(exported[name], torch.cat([r["shards"][name] for r in sharded[:2]])), name
    run("ep", 3, 1, "zero1")
    assert _close(losses(tmp_path / "ep"), losses(tmp_path / "base")), (losses(tmp_path / "ep"),
                                                                        losses(tmp_path / "base"))


def _dispatch(rank: int, world: int, routes: list) -> dict:
    """One MoE experts call through the ep dispatcher (eager and compiled) and through the whole experts, on the same
    tokens."""
    from torch._dynamo.utils import counters

    from zaya.config import ModelConfig
    from zaya.distributed.expert_parallel import ExpertParallel
    from zaya.distributed.runtime import start
    from zaya.model.moe import Experts

    cfg = ModelConfig(vocab_size=64, hidden_size=16, num_layers=1, num_query_heads=2, num_kv_heads=2, head_dim=8,
                      num_experts=4, expert_hidden_size=16, router_hidden_size=8, max_seq_len=16)
    torch.manual_seed(0)
    whole = Experts(cfg)
    whole.reset_parameters(0.1, 0.1)
    sharded, compiled = Experts(cfg), Experts(cfg)
    ep = ExpertParallel(start(device="cpu"), world)
    for module in (sharded, compiled):
        module.load_state_dict(whole.state_dict())
        ep.shard(module)
    torch.manual_seed(1 + rank)
    chosen = torch.tensor(routes[rank])
    x = torch.randn(chosen.shape[0], 16, requires_grad=True)
    w = torch.rand(chosen.shape, requires_grad=True)
    results = {}
    # under torch.compile (aot_eager traces what inductor would get): a graph break at the split lists' host read
    for name, module in (("whole", whole), ("ep", sharded),
                         ("compiled", torch.compile(compiled, backend="aot_eager", dynamic=False))):
        out = module(x, chosen, w)
        (out * torch.linspace(-1, 1, 16)).sum().backward()
        results[name] = {"out": out.detach(), "x": x.grad.clone(), "w": w.grad.clone()}
        x.grad = w.grad = None
    grads = torch.cat([p.grad.reshape(-1) for p in (whole.gate_up_proj, whole.down_proj)])
    torch.distributed.all_reduce(grads)  # the whole gradient over both ranks' tokens
    held = 4 // world
    full = [g.view_as(p)[rank * held:(rank + 1) * held] for g, p in
            zip(grads.split([whole.gate_up_proj.numel(), whole.down_proj.numel()]), (whole.gate_up_proj, whole.down_proj))]
    results["graphs"] = counters["stats"]["unique_graphs"]
    results["weight_grads"] = [(f, p.grad) for m in (sharded, compiled)
                               for f, p in zip(full, (m.gate_up_proj, m.down_proj))]
    return results


@pytest.mark.parametrize("routes", [
    # rank 0: everything to the skip class (sends nothing); rank 1: only its own experts (rank 0 receives nothing)
    [[[4, 4]] * 5, [[2, 3], [3, 2], [2, 2], [3, 4], [4, 2]]],
    [[[0, 3], [1, 4], [2, 0], [3, 1], [4, 4]], [[1, 2], [0, 0], [3, 4], [2, 1], [0, 3]]],
], ids=["one-rank-idle", "mixed"])
def test_the_dispatcher_gives_the_whole_experts_outputs_and_gradients(routes):
    for r in run_ok(_dispatch, 2, routes):
        for key in ("out", "x", "w"):
            for name in ("ep", "compiled"):
                torch.testing.assert_close(r[name][key], r["whole"][key], rtol=1e-6, atol=1e-6)
        assert r["graphs"] >= 2, r["graphs"]  # compiled, in pieces around the host read
        for want, got in r["weight_grads"]:  # None: no row reached this rank (reduce_gradients counts it zero)
            torch.testing.assert_close(torch.zeros_like(want) if got is None else got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # 4 processes on 2 cores
def test_expert_parallelism_with_context_parallelism(tmp_path, shakespeare_dataset):
    """4 ranks as dp 2 x cp 2, the experts split over pairs of ranks: the losses and norms of ep = 1."""
    base = _run(shakespeare_dataset, tmp_path / "base", 4, 3, 1, "zero1", "zaya+skip", train={"context_parallel": 2})
    sharded = _run(shakespeare_dataset, tmp_path / "ep", 4, 3, 2, "zero1", "zaya+skip",
                   train={"context_parallel": 2})
    for key in ("loss", "grad_norm"):
        assert _close(losses(tmp_path / "ep", key), losses(tmp_path / "base", key)), key
    assert sharded[0]["weights"] * 2 == base[0]["weights"]


@pytest.mark.slow  # 4 processes on 2 cores; degree 2 to 1 is covered by a fast test
def test_a_checkpoint_saved_at_degree_4_resumes_at_2_and_at_1(tmp_path, shakespeare_dataset):
    """Steps 1-2 on 4 ranks at ep = 4, then step 3 on 2 ranks at ep = 2 and, from a copy, at ep = 1: the losses of
    3 steps on 2 ranks without ep (the same global batch: 2 ranks accumulate 2 micro-batches)."""
    import shutil

    batch = {"global_batch_tokens": 512}
    _run(shakespeare_dataset, tmp_path / "base", 2, 3, 1, "zero1", "zaya+skip", train=dict(batch))
    _run(shakespeare_dataset, tmp_path / "at2", 4, 2, 4, "zero1", "zaya+skip", train=dict(batch))
    shutil.copytree(tmp_path / "at2", tmp_path / "at1")
    want = losses(tmp_path / "base")
    for run, ep in (("at2", 2), ("at1", 1)):
        _run(shakespeare_dataset, tmp_path / run, 2, 3, ep, "zero1", "zaya+skip", train=dict(batch))
        assert _close(losses(tmp_path / run), want), (run, losses(tmp_path / run), want)


def _strict_step(rank: int, world: int, dataset: str, root: str) -> dict:
    from zaya.distributed.runtime import start

    rt = start(timeout_s=60, startup_timeout_s=60)
    assert rt.strict, "ZAYA_STRICT_DEVICES=1 was not picked up"
    config = micro(dataset, root, 3, train={"expert_parallel": 2, "parallel": "zero1", "global_batch_tokens": 512},
                   model=ROUTERS["zaya+skip"])
    record, reads = strict_step(config, rt)  # also evaluates and saves under expert parallelism
    ours = sum(n for (what, where), n in reads.events.items() if "expert_parallel" in where)
    return {"reads": reads.total, "expert_reads": ours, "report": reads.report(),
            "accumulation": record["accumulation"], "layers": config.model.num_layers}


def test_a_step_under_expert_parallelism_reads_the_host_once_per_layer_and_forward(tmp_path, shakespeare_dataset):
    """Strict devices (no tensor of zaya's without a device) and the host reads of a step: the budget's, plus one
    per MoE layer and micro-batch forward (the all-to-all's split sizes), nothing else."""
    from zaya.train.step import HOST_READS_PER_STEP

    for v in run_ok(_strict_step, 2, str(shakespeare_dataset), str(tmp_path), env={"ZAYA_STRICT_DEVICES": "1"}):
        assert v["accumulation"] == 2
        assert v["expert_reads"] == v["layers"] * v["accumulation"], v["report"]
        assert v["reads"] - v["expert_reads"] <= HOST_READS_PER_STEP, v["report"]


def _lost_rank(rank: int, world: int, dataset: str, root: str) -> None:
    from zaya.distributed.runtime import start
    from zaya.train.trainer import Trainer

    config = micro(dataset, root, 2, train={"expert_parallel": 2, "timeout_s": 20.0})
    trainer = Trainer.build(config, start(timeout_s=20, startup_timeout_s=60), resume="never")
    if rank == 1:
        os._exit(0)  # gone before the first step's exchanges
    trainer.step()


def test_an_exchange_with_a_lost_rank_is_a_collective_error_naming_the_layer_and_ranks(tmp_path, shakespeare_dataset):
    results = run_ranks(_lost_rank, 2, str(shakespeare_dataset), str(tmp_path), timeout_s=120)
    error = results[0].error or ""
    assert results[0].exit_code == 6, error
    assert "CollectiveError: the expert all-to-all of blocks.0" in error and "ranks [0, 1]" in error, error


def _hung_peer(rank: int, world: int, dataset: str, root: str, what: str) -> None:
    """Rank 1 stops answering at its first exchange ``what`` (until rank 0 has given up, then it leaves); rank 0
    takes the step and writes how long it took. The ep groups wait 5 s (the runtime's timeout: they take it), the
    default group 60 s."""
    import dataclasses
    import time

    import zaya.distributed.expert_parallel as expert_parallel
    from zaya.distributed.runtime import start
    from zaya.train.trainer import Trainer

    done = Path(root) / "rank0-gave-up"
    if rank == 1:
        real = expert_parallel.all_to_all

        def hang(x, recv, send, group, where, w):
            if w == what:
                for _ in range(600):  # at most a minute
                    if done.exists():
                        break
                    time.sleep(0.1)
                os._exit(0)
            return real(x, recv, send, group, where, w)

        expert_parallel.all_to_all = hang
    rt = dataclasses.replace(start(timeout_s=60, startup_timeout_s=60), timeout_s=5.0)
    trainer = Trainer.build(micro(dataset, root, 2, train={"expert_parallel": 2}), rt, resume="never")
    began = time.monotonic()
    try:
        trainer.step()
    finally:
        done.write_text(f"{time.monotonic() - began:.1f}")


@pytest.mark.parametrize("what,layer", [("rows out", "blocks.0"), ("rows back, backward", "blocks.1")])
def test_a_peer_hung_after_the_counts_exchange_is_a_collective_error_naming_the_exchange(tmp_path, shakespeare_dataset,
                                                                                        what, layer):
    """A peer that went through the layer's counts exchange, then stops answering in the rows' forward exchange or
    in the backward's (the last layer's, the first exchanged there): within the ep group's timeout a
    CollectiveError (exit code 6) naming the layer, the exchange and the ep group's ranks."""
    results = run_ranks(_hung_peer, 2, str(shakespeare_dataset), str(tmp_path), what, timeout_s=120)
    error = results[0].error or ""
    assert results[0].exit_code == 6, error
    assert f"CollectiveError: the expert all-to-all of {layer}" in error and "ranks [0, 1]" in error, error
    assert f"ranks [0, 1]), {what}, did not complete" in error, error
    assert float((tmp_path / "rank0-gave-up").read_text()) < 30  # the ep group's 5 s, not the default group's 60
