"""The trainer: ``zaya train``, from one CPU process to many GPUs under torchrun.

``Trainer.build(config, runtime)`` assembles the parts (run directory, data, model in its parallel wrapper,
optimizers, checkpoint store) and restores them from a checkpoint when there is one; ``fit()`` runs the steps with
the callbacks' hooks around each; ``train(config)`` does all of it in one call. The parts, one step in order and
the hooks: docs/architecture.md ("The trainer as parts", "Callbacks").
"""

from __future__ import annotations

import math
import shutil
import signal
import time
from collections import deque
from contextlib import ExitStack, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from zaya.config import Config, to_dict
from zaya.core.device import autocast
from zaya.core.hardware import compute_dtype
from zaya.core.errors import NonFiniteLossError, disk_full, exit_code_of, writing
from zaya.core.layout import CHECKPOINTS, METRICS_FILE, TENSORBOARD, TOKENIZER_FILE
from zaya.distributed.runtime import Runtime, collective_error, start, stop
from zaya.train.callbacks import (Callback, CheckpointFailure, Checkpoints, Evaluation, MetricsFile, Plots,
                                  ProgressDisplay, Sample)
from zaya.core.compile import compile_wanted
from zaya.train.compile import CompiledBlocks
from zaya.train.metrics import RUN_DIR_ELSEWHERE
from zaya.train.routing_probe import RoutingProbe, probe_sequence
from zaya.train.run_dir import prepare_run_dir
from zaya.train.run_lock import RunLock
from zaya.train.schedule import Schedule, peak_lrs, set_lr, stage_at
from zaya.train.state import RNGState, RunCounters
from zaya.train.step import StepValues, TrainStep, full_sequences


class _StopRequest:
    """SIGTERM/SIGINT: finish the step, checkpoint, stop (exit code 75). A second SIGINT interrupts at once.

    ``requested`` is this process's own signal and stays set once it came; ``agreed`` is the ranks' decision,
    taken from the step's all-reduce of everyone's ``requested``, so that all ranks stop after the same step. A
    signal arriving after the step has read its flags (during the clip, the all-reduce or the host read) is
    carried into the next step's all-reduce instead of being overwritten by this one's result."""

    def __init__(self) -> None:
        self.requested = False
        self.agreed = False
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test runner thread)
                pass

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class Trainer:
    """A training run assembled from its parts; see the module docstring. Build it with ``Trainer.build``. It is
    the ``zaya.train.hooks.Run`` its callbacks receive."""

    run_lock: RunLock | None = None
    """Rank 0's hold on the run directory (one job per run directory), released by ``close()``."""

    def __init__(self, config: Config, runtime: Runtime, *, run_dir: Path, datasets: dict, schedule: Schedule,
                 loader, parallel, optimizers: list, store, callbacks: list[Callback], log,
                 compiled: CompiledBlocks | None = None) -> None:
        self.config, self.runtime, self.run_dir = config, runtime, run_dir
        self.compiled = compiled
        """The blocks under ``train.compile`` (None: eager); steps and validation run through it."""
        self.datasets, self.schedule, self.loader = datasets, schedule, loader
        self.parallel, self.optimizers, self.store = parallel, optimizers, store
        self.callbacks, self.log = callbacks, log
        self.peaks = peak_lrs(optimizers)
        self.progress = RunCounters()
        self.stop_request = _StopRequest()
        self.resumed_from: dict[str, Any] | None = None
        self.init_source = None
        """The resolved ``train.init_from`` (``zaya.checkpoint.init_from.InitSource``), or None."""
        self.finished: str = ""
        """Why the run had finished before this start ("" when it has steps to train): ``fit()`` then does nothing."""
        self.checkpoint_failed = False
        self.val_loss: float | None = None
        self._lr_scale = 1.0
        self._losses: deque[float] = deque(maxlen=10)
        self._first_loss: float | None = None
        self._train_seconds, self._trained_tokens = 0.0, 0
        self._flops_per_token: dict[int, float] = {}
        probe = None
        if config.train.router_probe:
            ids = probe_sequence(next(iter(datasets.values())), schedule.stages[0].seq_len, runtime.device)
            probe = None if ids is None else RoutingProbe(ids, config.model.num_layers)
        self.train_step = TrainStep(config, runtime, parallel, optimizers, probe=probe,
                                    stop_request=self.stop_request, store=store)
        self.peak_flops, self.peak_source = 0.0, ""

    # --- assembly ------------------------------------------------------------------------------------------
    @property
    def parts(self) -> dict[str, Any]:
        """The named stateful parts a checkpoint holds (a new kind of state registers itself here)."""
        from zaya.checkpoint.parts import ModelState, OptimizerState

        model, optim = ModelState(self.parallel.wrapped), OptimizerState(self.parallel.wrapped, self.optimizers)
        ep = self.parallel.experts
        if ep is not None:  # the expert shards saved whole: loadable at any expert-parallel degree
            model, optim = ep.consolidated(model), ep.consolidated(optim)
        return {"model": model, "optim": optim, "loader": self.loader, "progress": self.progress, "rng": RNGState()}

    @classmethod
    def build(cls, config: Config, runtime: Runtime, resume: str = "auto",
              callbacks: list[Callback] | None = None) -> "Trainer":
        """Assemble the parts (collective: every rank calls it) and resume from a checkpoint if there is one."""
        from zaya.checkpoint.store import CheckpointStore
        from zaya.train.build import build_data, build_model, build_optimizers_for, install_sequence_seam

        tc, ck = config.train, config.checkpoint
        display = ProgressDisplay(tc.max_steps, tc.log_every, runtime.is_main)
        log = display.log
        run_dir = Path(tc.run_dir)
        built: list[Any] = []
        try:
            init = None
            if tc.init_from:
                from zaya.checkpoint.init_from import merged_model_config, open_source

                init = open_source(tc.init_from, runtime, log)
                config = replace(config, model=merged_model_config(config.model, init))
            lock = _prepare_run_dir(config, runtime, run_dir, resume, log)
            built += [lock] if lock is not None else []
            datasets, loader = build_data(config, runtime, log)
            built.append(loader)
            _keep_tokenizer(runtime, run_dir, datasets, init, log)
            parallel = build_model(config, runtime, weights_later=init is not None)
            install_sequence_seam(parallel.model, config, runtime)
            compiled = CompiledBlocks(parallel.model, log) if compile_wanted(tc.compile, runtime.device) else None
            optimizers = build_optimizers_for(config, parallel)
            store = CheckpointStore(run_dir / CHECKPOINTS, config.checkpoint, runtime, parallel=tc.parallel,
                                    run_dir=run_dir, log=log)
            built.append(store)
        except BaseException:
            for part in reversed(built):
                part.close()
            display.on_stop(None, {})  # type: ignore[arg-type]
            raise
        standard: list[Callback] = [display, MetricsFile(run_dir / METRICS_FILE,
                                                         run_dir / TENSORBOARD if tc.tensorboard else None),
                                    Plots(), Sample(tc.sample_prompt, tc.sample_tokens, tc.seed)]
        scheduled: list[Callback] = [CheckpointFailure(), Evaluation(tc.eval_every, tc.max_steps),
                                     Checkpoints(ck.every, tc.max_steps)]
        trainer = cls(config, runtime, run_dir=run_dir, datasets=datasets, schedule=Schedule(config, runtime.dp_size),
                      loader=loader, parallel=parallel, optimizers=optimizers, store=store,
                      callbacks=standard + list(callbacks or []) + scheduled, log=log, compiled=compiled)
        trainer.run_lock = lock
        trainer.init_source = init
        try:
            trainer._resume(resume)
            if not trainer.finished:
                trainer._describe()
        except BaseException:
            trainer.close()
            raise
        return trainer

    def _resume(self, resume: str) -> None:
        from zaya.checkpoint.store import check_model_config, read_meta

        tc, init = self.config.train, self.init_source
        path = self.store.select(resume)
        if path is None:
            if init is not None:
                from zaya.checkpoint.init_from import load_weights

                load_weights(init, self.parallel.wrapped, self.runtime, self.parallel.experts)
                self.log(f"initialised from {init.path} ({init.kind} checkpoint {init.directory}): weights and router "
                         "balancing state loaded; optimizer, step and data start fresh")
            return
        if init is not None:
            self.log(f"train.init_from ignored: {self.run_dir} has checkpoints of its own, resuming from them")
        meta = read_meta(path)
        if int(meta["step"]) >= tc.max_steps:  # finished: nothing to load
            self.progress.step, self.progress.tokens = int(meta["step"]), int(meta["tokens"])
            self.finished = f"its final step {self.progress.step} (train.max_steps {tc.max_steps}) is checkpointed"
            self.resumed_from = {"path": str(path), "step": self.progress.step, "source": "disk"}
            return
        check_model_config(meta, to_dict(self.config.model), path)
        meta = self.store.load(path, self.parts)
        p = self.progress
        self.resumed_from = {"path": str(path), "step": p.step, "source": meta["loaded_from"]}
        self.log(f"resumed from {path}{' (RAM tier)' if meta['loaded_from'] == 'ram' else ''} (step {p.step}, "
                 f"{p.tokens:,} tokens; saved at world size {meta['world_size']} with {meta['parallel']}, now "
                 f"{self.runtime.world_size} with {self.config.train.parallel})")

    def _describe(self) -> None:
        from zaya.core.hardware import device_peak_flops
        from zaya.model.info import parameter_count

        tc, rt = self.config.train, self.runtime
        dtype = compute_dtype(tc.dtype, rt.device)
        self.peak_flops, self.peak_source = device_peak_flops(rt.device, tc.peak_flops, dtype)
        n_params = parameter_count(self.parallel.model.parameters())
        train_tokens = sum(d.split("train").num_tokens for d in self.datasets.values())
        self.log(f"zaya train: {n_params:,} parameters, {rt.world_size} rank(s) ({tc.parallel}, dp {rt.dp_size} x "
                 f"cp {rt.cp_size}, {rt.device.type}), {train_tokens:,} train tokens ({', '.join(self.datasets)}), "
                 f"{len(self.schedule.stages)} stage(s), dtype {dtype}{' (auto)' if tc.dtype == 'auto' else ''}"
                 f"{', blocks and loss compiled' if self.compiled is not None else ''}, peak {self.peak_flops / 1e12:.2f} "
                 f"TFLOP/s ({self.peak_source}); run dir {self.run_dir}"
                 + (f"; collectives: {self.parallel.describe()}" if self.parallel.describe() else ""))

    def tokenizer(self):
        return next(iter(self.datasets.values())).tokenizer()

    def autocast(self):
        return autocast(self.runtime.device, compute_dtype(self.config.train.dtype, self.runtime.device))

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    # --- the loop ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train until train.max_steps (or the data schedule's end, or a stop request); returns a summary."""
        tc, p = self.config.train, self.progress
        if not self.finished and self.resumed_from is not None \
                and self.schedule.plan(p.step, p.tokens, self.loader.state_dict()) is None:
            self.finished = f"its data schedule ended at step {p.step}"
        if self.finished:
            return self._already_finished()
        self.stop_request.install()
        try:
            self._call("on_start")
            first_val = self.evaluate() if p.step == 0 and tc.eval_every > 0 else None
            schedule_done, interrupted = False, False
            while p.step < tc.max_steps:
                self._call("on_step_start", p.step + 1)
                relaunch = self._context_parallel_change()
                if relaunch:
                    self._close_with_checkpoint("context parallel size change")
                    self.log(relaunch)
                    interrupted = True
                    break
                record = self.step()
                if record is None:
                    schedule_done = True
                    break
                self._call("on_step_end", record)  # the last callbacks: validation and checkpoints when due
                if self.stopping:
                    who = self.stop_request.signal_name or "signal on another rank"
                    self._close_with_checkpoint(f"stop requested ({who})")
                    interrupted = True
                    self.log(f"stopped at step {p.step} on request; resume with the same command")
                    break
            finished = not interrupted and (p.step >= tc.max_steps or schedule_done)
            if schedule_done:
                self.log(f"the data schedule ended after {p.tokens:,} tokens (step {p.step})")
            if finished:
                self.evaluate()
                self._close_with_checkpoint("final")
                self.store.forget_ram_tier()  # a finished run needs no crash-restart copy in host memory
            summary = {"step": p.step, "tokens": p.tokens, "first_val_loss": first_val, "val_loss": self.val_loss,
                       "first_loss": self._first_loss,
                       "final_loss": sum(self._losses) / len(self._losses) if self._losses else None,
                       "tokens_per_s": self._trained_tokens / self._train_seconds if self._train_seconds else None,
                       "run_dir": str(self.run_dir), "checkpoint": str(self.newest_checkpoint() or ""),
                       "finished": finished, "interrupted": interrupted, "resumed_from": self.resumed_from}
            if self.compiled is not None:
                # The model handed on (the sample's decoding, the caller) runs eagerly: one-token decode steps
                # at a moving position would recompile the blocks at every token.
                self.compiled.uncompile()
            self._call("on_stop", summary)
            return summary
        except BaseException as exc:
            error = collective_error(exc, tc.timeout_s) if isinstance(exc, Exception) else None
            self._call("on_error", error or exc)
            self._drop_ram_copy_unless_restarted(error or exc)
            if error is not None and error is not exc:
                raise error from exc
            raise
        finally:
            self.stop_request.uninstall()

    def _already_finished(self) -> dict[str, Any]:
        """A start on a finished run: say so and how to train further; no validation, plot, sample or record."""
        p = self.progress
        self.log(f"{self.run_dir} has finished: {self.finished} ({self.resumed_from['path']}); nothing to do. To train "
                 f"further raise train.max_steps (--max-steps N), or start a new run from its weights: --init-from "
                 f"{self.run_dir} --run-dir NEW_DIR")
        return {"step": p.step, "tokens": p.tokens, "first_val_loss": None, "val_loss": None, "first_loss": None,
                "final_loss": None, "tokens_per_s": None, "run_dir": str(self.run_dir),
                "checkpoint": self.resumed_from["path"], "finished": True, "interrupted": False,
                "resumed_from": self.resumed_from, "already_finished": True}

    def _drop_ram_copy_unless_restarted(self, exc: BaseException) -> None:
        """A run that ends in an error no supervisor will restart removes its RAM-tier copy (this rank's; no
        collective): it would hold host memory until the node reboots. An interruption (a second Ctrl-C) keeps
        it, as a stop on a signal does, for the resume its exit code asks for (zaya.checkpoint.ram_owners)."""
        from zaya.checkpoint.ram_owners import restart_expected

        if isinstance(exc, KeyboardInterrupt) or restart_expected(exit_code_of(exc)):
            return
        try:
            self.store.forget_ram_tier()
        except OSError as err:  # never hide the run's own error behind this one
            self.log(f"warning: could not remove the RAM-tier copy ({err})")

    def _context_parallel_change(self) -> str:
        """A message when the next step's stage runs with another context-parallel size than this process group
        (then the run stops with a checkpoint, to be relaunched with that size); "" otherwise."""
        stage = stage_at(self.schedule.stages, self.loader.state_dict())
        if stage is None:
            return ""
        need = self.config.stage_context_parallel(stage.name)
        if need == self.runtime.cp_size:
            return ""
        return (f"stage {stage.name!r} runs with context_parallel = {need}, this run has {self.runtime.cp_size}: "
                f"checkpoint written at step {self.progress.step}; relaunch the same command with "
                f"--set train.context_parallel={need} (on a world size that is a multiple of {need})")

    def full_sequences(self):
        """A context in which the model sees whole sequences in every process (validation, the routing probe,
        samples): context parallelism's seam is set aside."""
        return full_sequences(self.parallel.model)

    @property
    def stopping(self) -> bool:
        """The ranks agreed, in the last step's reduction, to stop after it."""
        return self.stop_request.agreed

    def scale_lr(self, factor: float) -> None:
        """Scale the learning rate of the coming step only (a hook's temporary cut, from ``on_step_start``)."""
        self._lr_scale *= factor

    def skip_batches(self, steps: int) -> int:
        """Consume the loader's micro-batches of the next ``steps`` steps without training on them; the step and
        token counters stay, and the loader's position is as if they had been trained on. Returns their count."""
        p, skipped = self.progress, 0
        for _ in range(steps):
            plan = self.schedule.plan(p.step, p.tokens, self.loader.state_dict())
            if plan is None:
                break
            for _ in range(plan.accumulation):
                try:
                    next(self.loader)
                except StopIteration:
                    break
                skipped += 1
        return skipped

    def step(self) -> dict[str, Any] | None:
        """One optimizer step (``zaya.train.step``) on the schedule's plan; returns its metrics record, or None
        when the data schedule has ended."""
        t0 = time.perf_counter()
        p = self.progress
        plan = self.schedule.plan(p.step, p.tokens, self.loader.state_dict())
        batches = self._read_micro_batches(plan.accumulation) if plan is not None else None
        if batches is None:
            return None
        self.parallel.model.set_rope_theta(plan.rope_theta)
        set_lr(self.optimizers, self.peaks, plan.lr_factor, self._lr_scale)
        self._lr_scale = 1.0
        values = self._eager_if_compile_fails(lambda: self.train_step(batches))
        self.stop_request.agreed, self.checkpoint_failed = values.stop_requested, values.checkpoint_failed
        consumed = sum(b.global_tokens for b in batches)
        p.tokens += consumed
        if not values.finite:
            return self._non_finite(plan, values)
        p.skipped_in_a_row = 0
        p.step += 1
        return self._record(plan, values, consumed, time.perf_counter() - t0)

    def _read_micro_batches(self, n: int) -> list | None:
        batches = []
        for _ in range(n):
            try:
                batches.append(next(self.loader))
            except StopIteration:
                return None
        return batches

    def _record(self, plan, values: StepValues, consumed: int, seconds: float) -> dict[str, Any]:
        from zaya.train.metrics import expert_load_stats

        seq_len = plan.stage.seq_len
        if seq_len not in self._flops_per_token:
            from zaya.model.info import forward_flops_per_token

            self._flops_per_token[seq_len] = 3 * sum(forward_flops_per_token(self.config.model, seq_len // 2).values())
        tok_s = consumed / seconds
        self._losses.append(values.loss)
        self._first_loss = values.loss if self._first_loss is None else self._first_loss
        self._train_seconds += seconds
        self._trained_tokens += consumed
        record = {"kind": "train", "step": self.progress.step, "loss": values.loss,
                  "lr": self.optimizers[-1].param_groups[0]["lr"], "grad_norm": values.grad_norm,
                  "tokens": self.progress.tokens, "tokens_per_s": tok_s, "step_time_s": seconds,
                  "mfu": self._flops_per_token[seq_len] * tok_s / (self.peak_flops * self.runtime.world_size),
                  "stage": plan.stage.name, "seq_len": seq_len, "global_batch_tokens": consumed,
                  "accumulation": plan.accumulation,
                  **expert_load_stats(values.expert_counts, self.config.model.num_experts), "time": time.time()}
        if values.probe:
            layers = self.config.model.num_layers
            record["router_flip_rate"] = [round(v, 5) for v in values.probe[:layers]] if values.probe_compared \
                else None
            record["router_token_entropy"] = [round(v, 5) for v in values.probe[layers:]]
        return record

    def _non_finite(self, plan, values: StepValues) -> dict[str, Any]:
        """Skip the step (train.on_nan = "skip", up to max_skipped_steps in a row) or stop naming the checkpoint."""
        from zaya.train.metrics import expert_load_stats

        tc, p, loss = self.config.train, self.progress, values.loss
        load = expert_load_stats(values.expert_counts, self.config.model.num_experts)
        detail = (f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step {p.step + 1} "
                  f"(loss {loss}, grad norm {values.grad_norm}, stage {plan.stage.name}); expert load max/mean per "
                  f"layer {load['expert_load_max_over_mean']}, skip share {load['skip_fraction']}")
        if tc.on_nan == "skip" and p.skipped_in_a_row < tc.max_skipped_steps:
            p.skipped_in_a_row += 1
            p.step += 1
            self.log(f"warning: {detail}; batch skipped ({p.skipped_in_a_row} in a row)")
            return {"kind": "train", "step": p.step, "skipped": True, "loss": loss, "tokens": p.tokens,
                    "time": time.time()}
        self.store.wait_quietly()  # a save of an earlier, good step still in flight is the last good checkpoint
        raise NonFiniteLossError(f"{detail}. Last good checkpoint: {self.newest_checkpoint() or 'none'}. Lower "
                                 'optim.lr, or set train.on_nan = "skip" to skip such batches')

    # --- evaluation and checkpoints ------------------------------------------------------------------------
    def evaluate(self) -> float | None:
        """Validation loss over every dataset's val split at the current stage's shape (collective); also kept as
        ``val_loss`` for the summary."""
        from zaya.eval.perplexity import loss_totals, perplexity

        rt, dc, p = self.runtime, self.config.data, self.progress
        stage = stage_at(self.schedule.stages, self.loader.state_dict()) or self.schedule.stages[-1]
        total = torch.zeros(2, dtype=torch.float64, device=rt.device)
        for dataset in self.datasets.values():
            if dataset.split("val").num_tokens <= stage.seq_len * stage.micro_batch_size * rt.dp_size:
                continue
            with self.full_sequences():  # under cp every rank of a cp group scores its dp rank's share in full
                part, _ = self._eager_if_compile_fails(lambda: loss_totals(
                    self.parallel.wrapped, dataset, stage.seq_len, stage.micro_batch_size, dc.val_batches, "val",
                    compute_dtype(self.config.train.dtype, rt.device), rt, dc.document_positions, dc.document_mask))
            total += part
        loss_sum, count = rt.read(rt.all_reduce(total, over="dp"))
        self.val_loss = None if count == 0 else loss_sum / count
        if self.val_loss is not None:
            self._call("on_evaluation", {"kind": "val", "step": p.step, "tokens": p.tokens, "val_loss": self.val_loss,
                                         "val_ppl": perplexity(self.val_loss), "time": time.time()})
        return self.val_loss

    def _eager_if_compile_fails(self, work):
        """``work()`` (a step, a validation); under ``train.compile``, redone eagerly if compiling fails."""
        return work() if self.compiled is None else self.compiled.run(work)

    def save(self, reason: str) -> None:
        """Checkpoint now (collective). Periodic saves run in the background (checkpoint.async_save); any other
        is the run's closing save (final, on a signal, before a relaunch): it blocks until committed, and its
        failure raises CheckpointError (exit 5) whatever checkpoint.on_error says."""
        p = self.progress
        # The store adds step, world_size, parallel and save_id.
        meta = {"tokens": p.tokens, "model_config": to_dict(self.config.model), "reason": reason, "time": time.time()}
        self.store.save(p.step, self.parts, meta, ram_copy=reason != "final",
                        closing="" if reason == "periodic" else reason)
        self._call("on_save", p.step, reason)

    def _close_with_checkpoint(self, reason: str) -> None:
        """The run stops after this step: make sure a checkpoint of it is committed (collective). A save still
        in flight is collected first; unless it (or the resume) already holds this step, the closing save is
        written, and its failure ends the run with exit 5: nothing would be saved after it."""
        step = self.progress.step
        self.store.wait(closing=True)
        resumed_here = self.resumed_from is not None and self.resumed_from["step"] == step
        if not (resumed_here or self.store.committed(step)):
            self.save(reason)

    def newest_checkpoint(self) -> Path | None:
        from zaya.checkpoint.store import latest_checkpoint

        return latest_checkpoint(self.run_dir / CHECKPOINTS)

    def close(self) -> None:
        """Finish a save in flight, stop the loader's thread and close what callbacks hold open (every rank;
        idempotent)."""
        self.store.close()
        self.loader.close()
        for callback in self.callbacks:
            if callable(getattr(callback, "close", None)):
                callback.close()
        if self.run_lock is not None:  # last: the run directory is free once nothing writes to it
            self.run_lock.release()


def _keep_tokenizer(rt: Runtime, run_dir: Path, datasets: dict, init, log) -> None:
    """Rank 0 copies the run's tokenizer into the run directory (collective: a refusal fails every rank): the
    source's files under ``train.init_from`` (``check_tokenizer``: the data must have been prepared with it),
    else the data's tokenizer.json."""
    error = None
    if rt.is_main:
        try:
            source = None
            if init is not None:
                from zaya.checkpoint.init_from import check_tokenizer

                source = check_tokenizer(init, datasets, log)
            with writing(run_dir, "copying the tokenizer into the run directory", RUN_DIR_ELSEWHERE):
                if source is not None:
                    from zaya.data.tokenizer import copy_tokenizer_files

                    copy_tokenizer_files(source, run_dir)
                else:
                    shutil.copyfile(next(iter(datasets.values())).directory / TOKENIZER_FILE, run_dir / TOKENIZER_FILE)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by agree()
            error = exc
    rt.agree(error, "start-up (the run's tokenizer)")


def _prepare_run_dir(config: Config, rt: Runtime, run_dir: Path, resume: str, log) -> RunLock | None:
    """Rank 0 takes the run directory (its lock: one job per run directory) and prepares it; then every rank must
    see it (a marker file). Returns rank 0's lock (None on the other ranks)."""
    from zaya.distributed.shared_fs import check_shared_directory

    error, lock = None, None
    if rt.is_main:
        try:
            lock = prepare_run_dir(run_dir, config, resume, log)
        except Exception as exc:  # every rank must learn that rank 0 failed, or they hang in the next collective
            error = disk_full(exc, run_dir, "preparing the run directory", RUN_DIR_ELSEWHERE) or exc
    try:
        rt.agree(error, "start-up (the run directory)")
        check_shared_directory(rt, run_dir, "train.run_dir")
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def train(config: Config, resume: str = "auto", callbacks: list[Callback] | None = None) -> dict[str, Any]:
    """Run training as configured (one process, or one rank under torchrun); returns the summary."""
    from zaya.distributed.checks import ExplicitDevices

    tc = config.train
    rt = start(tc.timeout_s, tc.startup_timeout_s, tc.device, cp_size=tc.context_parallel)
    trainer = None
    try:
        with ExitStack() as stack:
            stack.enter_context(ExplicitDevices() if rt.strict else nullcontext())
            trainer = Trainer.build(config, rt, resume, callbacks)
            return trainer.fit()
    except Exception as exc:
        error = collective_error(exc, tc.timeout_s)
        if error is not None and error is not exc:
            raise error from exc
        raise
    finally:
        if trainer is not None:
            trainer.close()
        stop(rt)
