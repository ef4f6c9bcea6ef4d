"""Context-parallel training through the trainer: a cp = 2 run's per-step losses equal one process's (both
attention methods, with DDP, ZeRO-1 and FSDP2, with document masks and activation checkpointing), dp x cp on 4
ranks, checkpoints that resume across cp sizes both ways, and a stage that asks for another cp size.

fp32 throughout; losses are compared to 1e-5 relative: the cp run sums the same terms in another order (two
chunks' losses, all-reduced) and the attention merges blocks, both at fp32 rounding (seen: about 1e-6)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import MICRO_CONFIG
from dist_helpers import run_ok, run_ranks
from model_helpers import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def micro(dataset, run_dir, **tables):
    from zaya.config import config_from_dict

    data = tomllib.loads(MICRO_CONFIG.format(dataset=dataset, run_dir=run_dir))
    data["train"].update({"dtype": "float32", "eval_every": 0, "sample_tokens": 0, "max_steps": 3})
    data["optim"]["muon_ns_dtype"] = "float32"
    data["checkpoint"].update({"every": 0, "ram_tier": False})
    for table, values in tables.items():
        if table == "stages":
            data["stages"] = values
        else:
            data.setdefault(table, {}).update(values)
    return config_from_dict(data, "micro")


def losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("kind") == "train"]


def _train(rank: int, world: int, dataset: str, run_dir: str, tables: dict) -> dict:
    from zaya.train.trainer import train

    summary = train(micro(dataset, run_dir, **tables))
    return {"interrupted": summary["interrupted"], "step": summary["step"]}


def _single(dataset, run_dir, **tables) -> list[float]:
    from zaya.train.trainer import train

    train(micro(dataset, run_dir, **tables))
    return losses(run_dir)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


DOCS = {"document_positions": True, "document_mask": True}


@pytest.fixture(scope="module")
def one_process(shakespeare_dataset, tmp_path_factory):
    """Per-step losses of one process: plain, and with document masks."""
    root = tmp_path_factory.mktemp("one")
    return {False: _single(shakespeare_dataset, root / "plain"), True: _single(shakespeare_dataset, root / "docs",
                                                                                data=DOCS)}


@pytest.mark.parametrize("method,parallel,docs,recompute", [
    pytest.param("allgather", "ddp", False, False, marks=pytest.mark.slow),  # parts covered by the two below
    ("ring", "fsdp", True, False),
    ("allgather", "zero1", True, True),
])
def test_cp2_training_equals_one_process(tmp_path, shakespeare_dataset, one_process, method, parallel, docs,
                                         recompute):
    train = {"context_parallel": 2, "context_parallel_method": method, "parallel": parallel,
             "activation_checkpointing": recompute}
    run_ok(_train, 2, str(shakespeare_dataset), str(tmp_path / "cp"), {"train": train, "data": DOCS if docs else {}})
    got = losses(tmp_path / "cp")
    assert _close(got, one_process[docs]), (got, one_process[docs])


@pytest.mark.slow  # 4 processes on 2 cores; the cp and dp halves are each covered on 2 ranks
def test_dp2_by_cp2_on_four_ranks_equals_one_process(tmp_path, shakespeare_dataset):
    """Two data-parallel groups of two cp ranks: one process with the same global batch (accumulating 2)."""
    reference = _single(shakespeare_dataset, tmp_path / "one", train={"global_batch_tokens": 256, "max_steps": 2})
    train = {"context_parallel": 2, "global_batch_tokens": 256, "max_steps": 2, "parallel": "zero1"}
    run_ok(_train, 4, str(shakespeare_dataset), str(tmp_path / "cp"), {"train": train})
    assert _close(losses(tmp_path / "cp"), reference)


def test_a_checkpoint_resumes_at_another_cp_size(tmp_path, shakespeare_dataset, one_process):
    """Both ways in one run: one process's step-1 checkpoint resumed on 2 cp ranks, their step-2 one in one
    process."""
    run = str(tmp_path / "run")
    for cp, steps in ((1, 1), (2, 2), (1, 3)):
        tables = {"train": {"context_parallel": cp, "max_steps": steps}}
        if cp == 1:
            _single(shakespeare_dataset, run, **tables)
        else:
            run_ok(_train, cp, str(shakespeare_dataset), run, tables)
    assert _close(losses(run), one_process[False]), (losses(run), one_process[False])


def test_a_stage_with_another_cp_size_stops_with_a_checkpoint_and_says_how_to_relaunch(tmp_path,
                                                                                        shakespeare_dataset):
    from zaya.train.trainer import Trainer
    from zaya.distributed.runtime import start

    stages = [{"name": "short", "tokens": 256}, {"name": "long", "seq_len": 64, "context_parallel": 2}]
    config = micro(shakespeare_dataset, tmp_path / "run", stages=stages)
    messages: list[str] = []
    trainer = Trainer.build(config, start(), resume="never")
    trainer.log = messages.append
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary["interrupted"] and summary["step"] == 2  # 256 tokens = 2 steps of 4 x 32
    assert any("--set train.context_parallel=2" in m and "'long'" in m for m in messages), messages
    assert trainer.newest_checkpoint() is not None and trainer.newest_checkpoint().name.endswith("2")


def test_seq_lens_that_cp_cannot_split_are_config_errors(shakespeare_dataset, tmp_path):
    from zaya.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.seq_len = 30 .*context_parallel = 2"):
        micro(shakespeare_dataset, tmp_path, train={"context_parallel": 2, "seq_len": 30})
    with pytest.raises(ConfigError, match=r"stage 'long': seq_len = 36 .*context_parallel = 4"):
        micro(shakespeare_dataset, tmp_path, stages=[{"name": "long", "seq_len": 36, "context_parallel": 4}])
    with pytest.raises(ConfigError, match="document_mask = true needs data.document_positions"):
        micro(shakespeare_dataset, tmp_path, data={"document_mask": True})


def test_a_cp_size_the_processes_cannot_hold_is_a_config_error_naming_the_fix(tmp_path, shakespeare_dataset, capsys):
    from zaya.cli import main
    from zaya.core.errors import CONFIG_ERROR

    config = tmp_path / "micro.toml"
    config.write_text(MICRO_CONFIG.format(dataset=shakespeare_dataset, run_dir=tmp_path / "run"))
    assert main(["train", "--config", str(config), "--set", "train.context_parallel=2"]) == CONFIG_ERROR
    err = capsys.readouterr().err
    assert "train.context_parallel = 2" in err and "--nproc-per-node 2" in err and "Traceback" not in err
    for r in run_ranks(_train, 3, str(shakespeare_dataset), str(tmp_path / "three"),
                       {"train": {"context_parallel": 2}}):
        assert r.exit_code == CONFIG_ERROR, r.error
        assert "does not divide the world size 3" in r.error and "[1, 3]" in r.error, r.error


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    model = tiny_model(vocab_size=128, hidden_size=64, num_query_heads=2, head_dim=32, expert_hidden_size=64)
    ids = torch.randint(0, 128, (2, 32))
    grads = []
    for recompute in (False, True):
        model.activation_checkpointing = recompute
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                          if p.grad is not None}))
    (loss_a, ga), (loss_b, gb) = grads
    assert torch.equal(loss_a, loss_b) and ga.keys() == gb.keys()
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-6, rtol=1e-5), name
