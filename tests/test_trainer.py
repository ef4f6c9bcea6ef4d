"""The trainer as parts, in one process: the callback protocol, the host-read budget of a step, validation through
the eval code, the keys that may change on resume, and the exit codes `zaya train` ends with."""

from __future__ import annotations

import json

import pytest
import torch

from zaya.cli import main
from zaya.config import Config, TrainConfig, config_differences, load_config
from zaya.distributed.runtime import Runtime


def build(cfg_path, *overrides: str, resume: str = "never", callbacks=None):
    from zaya.train.trainer import Trainer

    return Trainer.build(load_config(cfg_path, list(overrides)), Runtime(), resume=resume, callbacks=callbacks)


class Recorder:
    """A callback that records the hooks it receives (a subclass of nothing: the protocol is duck-typed too)."""

    def __init__(self):
        self.events = []

    def on_start(self, trainer):
        self.events.append(("start", trainer.progress.step))

    def on_step_start(self, trainer, step):
        self.events.append(("begin", step))

    def on_step_end(self, trainer, record):
        self.events.append(("step", record["step"]))

    def on_evaluation(self, trainer, record):
        self.events.append(("val", record["step"]))

    def on_save(self, trainer, step, reason):
        self.events.append(("save", step, reason))

    def on_stop(self, trainer, summary):
        self.events.append(("stop", summary["finished"]))

    def on_error(self, trainer, error):
        self.events.append(("error", type(error).__name__))


def test_callbacks_see_the_run_in_order_and_a_hook_acts_on_the_next_step(tmp_path, micro_config):
    """The hooks in order; and what Aegis's directives use before a step: skip_batches moves the loader on, never
    the counters, and scale_lr holds for the coming step only."""
    from zaya.train.schedule import lr_factor
    from zaya.train.trainer import Trainer

    class CutStep3(Recorder):
        def on_step_start(self, trainer, step):
            if step == 3:
                self.skipped = trainer.skip_batches(1)
                trainer.scale_lr(0.5)

        def on_step_end(self, trainer, record):
            self.events.append(record)

    rec, cut = Recorder(), CutStep3()
    trainer = build(micro_config(tmp_path / "run"), "train.max_steps=4", "train.eval_every=2",
                    "checkpoint.every=2", callbacks=[rec, cut])
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert isinstance(trainer, Trainer) and summary["finished"]
    assert rec.events == [("start", 0), ("val", 0), ("begin", 1), ("step", 1), ("begin", 2), ("step", 2), ("val", 2),
                          ("save", 2, "periodic"), ("begin", 3), ("step", 3), ("begin", 4), ("step", 4), ("val", 4),
                          ("save", 4, "final"), ("stop", True)]
    records = [e for e in cut.events if isinstance(e, dict)]
    oc, peak, steps = trainer.config.optim, trainer.peaks[-1][0], trainer.config.train.max_steps
    assert [r["lr"] for r in records] == [peak * lr_factor(0, oc, steps), peak * lr_factor(1, oc, steps),
                                          peak * 0.5 * lr_factor(2, oc, steps), peak * lr_factor(3, oc, steps)]
    assert cut.skipped == 1 and summary["tokens"] == 4 * 128  # 4 steps of 4 x 32 tokens trained, 1 skipped
    assert trainer.loader.state_dict()["stage_tokens"] == 5 * 128


def test_an_error_reaches_the_callbacks_and_is_raised(tmp_path, micro_config, monkeypatch):
    rec = Recorder()
    trainer = build(micro_config(tmp_path / "run"), "train.eval_every=0", callbacks=[rec])

    def broken(*args, **kwargs):
        raise RuntimeError("a torch error inside the step")

    monkeypatch.setattr(trainer.parallel.wrapped, "forward", broken)
    try:
        with pytest.raises(RuntimeError, match="inside the step"):
            trainer.fit()
    finally:
        trainer.close()
    assert rec.events == [("start", 0), ("begin", 1), ("error", "RuntimeError")]


def test_a_signal_during_a_steps_collectives_stops_the_run_after_the_next_step(tmp_path, micro_config, monkeypatch):
    """The step reads the stop flag before its clip, all-reduce and host read; a SIGTERM that lands in between
    must not be overwritten by that step's (flag-less) result, and is carried into the next step's all-reduce."""
    import signal

    import zaya.train.step as step_module

    trainer = build(micro_config(), "train.max_steps=6", "train.eval_every=0", "checkpoint.every=0")
    original, calls = step_module.clip_gradients, []

    def clip_then_signal(params, max_norm, experts=None):
        calls.append(1)
        norm = original(params, max_norm, experts)
        if len(calls) == 2:  # step 2, after it read the flag, before its all-reduce
            trainer.stop_request._handle(signal.SIGTERM, None)
        return norm

    monkeypatch.setattr(step_module, "clip_gradients", clip_then_signal)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary["interrupted"] and not summary["finished"] and summary["step"] == 3, summary
    assert trainer.newest_checkpoint().name.endswith("3")


def test_a_step_reads_the_host_once_whatever_its_accumulation(tmp_path, micro_config):
    from zaya.distributed.checks import HostReads
    from zaya.train.step import HOST_READS_PER_STEP

    # 4 micro-batches per step; bf16 autocast (the default); the skip class is on in the micro model; hidden 128,
    # so that the experts' [256, 128] matrices take Muon's Gram-space path (with its one read of the drift checks).
    trainer = build(micro_config(tmp_path / "run"), "train.global_batch_tokens=512", "model.hidden_size=128")
    try:
        trainer.step()  # the first step also creates the optimizers' state
        with HostReads() as reads:
            record = trainer.step()
    finally:
        trainer.close()
    assert record["accumulation"] == 4
    # The budget: the trainer's read of the step's scalars and Muon's read of its Gram drift checks, nothing else.
    assert reads.total <= HOST_READS_PER_STEP == 2, reads.report()
    assert sorted(place.split(":")[0] for (_, place) in reads.events) == ["zaya/distributed/runtime.py",
                                                                           "zaya/optim/muon_work.py"], reads.report()


def test_validation_is_the_eval_code_and_is_token_weighted(tmp_path, micro_config, shakespeare_dataset):
    from zaya.data.bundle import PreparedDataset
    from zaya.eval.perplexity import evaluate_loss

    trainer = build(micro_config(tmp_path / "run"), "train.dtype=\"float32\"")
    try:
        val = trainer.evaluate()
        direct = evaluate_loss(trainer.parallel.model, PreparedDataset(shakespeare_dataset), seq_len=32,
                               batch_size=4, max_batches=2, dtype="float32")
    finally:
        trainer.close()
    assert val == direct["loss"]
    assert direct["tokens"] == 2 * 4 * 32


def test_which_keys_may_change_on_resume_is_declared_on_the_fields():
    import dataclasses

    base = Config()
    resumable = {f"{t.name}.{f.name}" for t in dataclasses.fields(Config) if t.name != "stages"
                 for f in dataclasses.fields(getattr(base, t.name)) if f.metadata.get("resumable")}
    assert {"train.max_steps", "train.parallel", "train.device", "train.run_dir", "checkpoint.every",
            "data.prefetch", "data.node_local"} <= resumable
    assert "train.seed" not in resumable and "optim.lr" not in resumable and "model.hidden_size" not in resumable
    changed = Config(train=TrainConfig(max_steps=7, parallel="fsdp", seed=5, device="cpu"))
    assert config_differences(base, changed) == ["train.seed"]


def test_exit_codes_of_zaya_train(tmp_path, micro_config, monkeypatch, capsys):
    import zaya.train.step as step_module
    import zaya.train.trainer as trainer_module

    cfg = micro_config(tmp_path / "run")
    # A config error: 2.
    assert main(["train", "--config", str(cfg), "--set", "train.parallel=\"tp\""]) == 2
    # A torch error inside a step is a bug (70) with its traceback, never a config error (2).
    real_step = trainer_module.Trainer.step

    def failing_step(self):
        raise ValueError("shape mismatch deep inside torch")

    monkeypatch.setattr(trainer_module.Trainer, "step", failing_step)
    assert main(["train", "--config", str(cfg), "--resume", "never"]) == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error" in err and "shape mismatch" in err
    monkeypatch.setattr(trainer_module.Trainer, "step", real_step)
    # A non-finite loss: 4.
    real_clip = step_module.clip_gradients
    monkeypatch.setattr(step_module, "clip_gradients", lambda params, max_norm, experts=None: torch.full_like(
        real_clip(params, max_norm, experts), float("inf")))
    assert main(["train", "--config", str(cfg), "--resume", "never"]) == 4
    assert "non-finite gradient norm at step 1" in capsys.readouterr().err


def test_the_table_of_exit_codes_is_documented():
    from pathlib import Path

    from zaya.core import errors

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    for code in (errors.FINISHED, errors.CONFIG_ERROR, errors.DATA_ERROR, errors.NON_FINITE, errors.CHECKPOINT_ERROR,
                 errors.COLLECTIVE_ERROR, errors.INTERRUPTED, errors.INTERNAL_ERROR):
        assert f"| {code} " in doc, f"exit code {code} is not in docs/architecture.md"


def test_metrics_records_are_written_by_the_metrics_callback(tmp_path, micro_config):
    trainer = build(micro_config(tmp_path / "run"), "train.max_steps=2", "train.eval_every=0")
    try:
        trainer.fit()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["train", "train", "val"]
