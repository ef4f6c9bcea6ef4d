"""The training loop: `zaya train`, from one CPU process to many GPUs under torchrun.

One step: read ``accumulation`` micro-batches (the global batch in tokens divided by one micro-step over all
ranks, which follows the batch-size ramp), forward under autocast, backward (the gradient all-reduce only on the
last micro-batch), clip, one Muon + AdamW step, the router's bias-balancing update from the step's global expert
counts, then metrics, validation and checkpoints on their schedules. Stages (sequence length, mixture, RoPE base)
come from the data loader, which knows the token count at which each starts.

Exact resume: a checkpoint holds the model (router balancing state included), both optimizers, the data loader's
position and the step and token counters; the LR schedule is a function of the step and the batch ramp of the
token count, so a resumed run repeats the uninterrupted one's losses (bit-identical in a single process).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import random
import shutil
import signal
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zaya.config import Config, ConfigError, dump_config, load_config, to_dict

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINTS = "checkpoints"

# Keys that may differ when a run is resumed (they change how the run is driven, not what it computes).
# Every [checkpoint] key may change too (how often and how checkpoints are written is not part of the run).
_RESUMABLE_CHANGES = {"train.max_steps", "train.log_every", "train.eval_every", "train.timeout_s",
                      "train.startup_timeout_s", "train.peak_flops",
                      "train.on_nan", "train.max_skipped_steps", "train.sample_prompt", "train.sample_tokens",
                      "train.tensorboard", "train.run_dir", "train.parallel", "train.micro_batch_size",
                      "data.prefetch", "data.cache_dir"}


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, a broken data schedule); the message says what to do."""

    exit_code = 1


class _Stop:
    """SIGTERM/SIGINT: finish the step, checkpoint, exit 0. A second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
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


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and key not in ("datasets", "weights"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(old: Config, new: Config) -> list[str]:
    """Keys (table.key) whose values differ in a way that makes ``new`` a different run from ``old``."""
    a, b = _flatten(to_dict(old)), _flatten(to_dict(new))
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k not in _RESUMABLE_CHANGES
            and not k.startswith("checkpoint.")]


def _rng_state() -> dict[str, Any]:
    return {"python": base64.b64encode(json.dumps(random.getstate()).encode()).decode(),
            "numpy": base64.b64encode(json.dumps(np.random.get_state()[1].tolist()).encode()).decode(),
            "numpy_pos": int(np.random.get_state()[2]),
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def _set_rng_state(state: dict[str, Any]) -> None:
    py = json.loads(base64.b64decode(state["python"]))
    random.setstate((py[0], tuple(py[1]), py[2]))
    keys = np.array(json.loads(base64.b64decode(state["numpy"])), dtype=np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()))


def prepare_run_dir(run_dir: Path, config: Config, resume: str, say) -> None:
    """Refuse a run directory owned by a different config; with ``--resume never`` move an old run aside."""
    existing = run_dir / CONFIG_FILE
    if resume == "never" and run_dir.exists() and any(run_dir.iterdir()):
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
        run_dir.rename(aside)
        say(f"--resume never: moved the previous run in {run_dir} to {aside}")
    elif existing.is_file():
        try:
            old = load_config(existing)
        except ConfigError as err:
            raise ConfigError(f"{run_dir} holds a run whose {CONFIG_FILE} cannot be read ({err}); use "
                              "--resume never to move it aside, or another --run-dir") from None
        diff = config_differences(old, config)
        if diff:
            shown = ", ".join(diff[:6]) + (" ..." if len(diff) > 6 else "")
            raise ConfigError(f"{run_dir} belongs to a run with a different config ({shown} differ); resume it "
                              f"with its own config ({existing}), or pass --resume never (moves it aside) or "
                              "another --run-dir")
    elif run_dir.exists() and any(p.name not in (CHECKPOINTS,) for p in run_dir.iterdir()):
        raise ConfigError(f"{run_dir} exists and is not a zaya run directory (no {CONFIG_FILE}); choose another "
                          "--run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / CONFIG_FILE)


def _stages(config: Config):
    from zaya.data.loader import Stage

    mixture = config.data.mixture()
    if not config.stages:
        return [Stage("main", config.train.seq_len, config.train.micro_batch_size, mixture, 0)]
    return [Stage(s.name, s.seq_len or config.train.seq_len, s.micro_batch_size or config.train.micro_batch_size,
                  s.weights or mixture, s.tokens) for s in config.stages]


def _set_rope_theta(model, theta: float) -> None:
    if model.rope.theta != theta:
        model.rope.theta = theta
        model.rope.reset_parameters()


def train(config: Config, resume: str = "auto") -> dict[str, Any]:
    """Run training as configured; returns a summary (final losses, throughput, paths). See the module docstring."""
    from zaya.checkpoint.store import CheckpointError, CheckpointStore, check_model_config, latest_checkpoint
    from zaya.data.bundle import PreparedDataset
    from zaya.data.cache import resolve_dataset
    from zaya.data.loader import DataLoader, check_vocabulary, validation_batches
    from zaya.dist.parallel import wrap
    from zaya.dist.runtime import start, stop
    from zaya.model import ZayaForCausalLM, update_balancing_biases
    from zaya.model.info import forward_flops_per_token
    from zaya.optim.build import (ParamSplit, accumulation_steps, build_optimizers, global_batch_tokens, lr_factor,
                                  peak_lrs, set_lr, split_parameters)
    from zaya.train.metrics import (MetricsLog, Progress, device_peak_flops, expert_load_stats, perplexity)

    tc, mc, dc, oc = config.train, config.model, config.data, config.optim
    rt = start(tc.timeout_s, tc.startup_timeout_s)
    progress = Progress(tc.max_steps, 0, rt.is_main, tc.log_every)
    say = progress.say
    run_dir = Path(tc.run_dir)
    checkpoints = run_dir / CHECKPOINTS
    metrics_log = None
    loader = None
    store = None
    stopper = _Stop()
    try:
        # --- run directory, data, model, optimizers ---------------------------------------------------------
        error = None
        if rt.is_main:
            try:
                prepare_run_dir(run_dir, config, resume, say)
                specs = {n: resolve_dataset(s, dc.builtin_vocab_size, dc.cache_dir, log=say)
                         for n, s in dc.datasets.items()}
            except Exception as exc:  # every rank must learn that rank 0 failed, or they hang in the barrier
                error, specs = exc, None
        else:
            specs = None
        error_text = rt.broadcast_object(repr(error) if error is not None else None)
        if error is not None:
            raise error
        if error_text is not None:
            raise TrainingError(f"rank 0 failed during start-up: {error_text}")
        specs = rt.broadcast_object({n: str(p) for n, p in specs.items()} if specs else None)
        datasets = {n: PreparedDataset(p) for n, p in specs.items()}
        for dataset in datasets.values():
            check_vocabulary(dataset, mc.vocab_size, mc.eos_token_id)
        first = next(iter(datasets.values()))
        if rt.is_main:
            shutil.copyfile(first.directory / TOKENIZER_FILE, run_dir / TOKENIZER_FILE)
        stages = _stages(config)
        loader = DataLoader(datasets, stages, rank=rt.rank, world_size=rt.world_size, seed=dc.seed,
                            document_positions=dc.document_positions, prefetch=dc.prefetch)

        torch.manual_seed(tc.seed)
        random.seed(tc.seed)
        np.random.seed(tc.seed)
        model = ZayaForCausalLM(mc).to(rt.device)
        n_params = sum(p.numel() for p in model.parameters())
        par = wrap(model, tc.parallel, rt)
        split = split_parameters(model, oc.muon)
        owned = ParamSplit(par.owned(split.muon), par.owned(split.adamw_decay), par.owned(split.adamw_no_decay))
        optimizers = build_optimizers(owned, oc)
        peaks = peak_lrs(optimizers)
        store = CheckpointStore(checkpoints, config.checkpoint, rank=rt.rank, world_size=rt.world_size,
                                distributed=rt.distributed, parallel=tc.parallel, run_dir=run_dir, log=say,
                                timeout_s=tc.timeout_s)
        model_config = to_dict(mc)

        step, tokens = 0, 0
        start_tokens = 0
        resumed_from = None
        start_path = store.select(resume)
        if start_path is not None:
            meta_probe = json.loads((start_path / "meta.json").read_text())
            check_model_config(meta_probe, model_config, start_path)
            meta = store.load(start_path, model, optimizers)
            loader.load_state_dict(meta["loader"])
            step, tokens = meta["step"], meta["tokens"]
            start_tokens = tokens
            resumed_from = {"path": str(start_path), "step": step, "source": meta["loaded_from"]}
            _set_rng_state(meta["rng"])
            say(f"resumed from {start_path}{' (RAM tier)' if meta['loaded_from'] == 'ram' else ''} (step {step}, "
                f"{tokens:,} tokens; saved at world size "
                f"{meta['world_size']} with {meta['parallel']}, now {rt.world_size} with {tc.parallel})")
        if step >= tc.max_steps:
            say(f"already at step {step} >= max_steps {tc.max_steps}: nothing to train")

        autocast = (lambda: torch.autocast(rt.device.type, dtype=torch.bfloat16)) if tc.dtype == "bfloat16" \
            else nullcontext
        peak, peak_source = device_peak_flops(rt.device, tc.peak_flops)
        metrics_log = MetricsLog(run_dir / METRICS_FILE, rt.is_main,
                                 run_dir / "tensorboard" if tc.tensorboard else None)
        progress.close()
        progress = Progress(tc.max_steps, step, rt.is_main, tc.log_every)
        say = progress.say
        store.log = say
        train_tokens = sum(d.split("train").num_tokens for d in datasets.values())
        say(f"zaya train: {n_params:,} parameters, {rt.world_size} rank(s) ({tc.parallel}, {rt.device.type}), "
            f"{train_tokens:,} train tokens ({', '.join(datasets)}), {len(stages)} stage(s), dtype {tc.dtype}, "
            f"peak {peak / 1e12:.2f} TFLOP/s ({peak_source}); run dir {run_dir}")
        stopper.install()

        def evaluate(at_step: int) -> float | None:
            current = _stage_at(stages, loader.state_dict()) or stages[-1]
            seq_len, micro = current.seq_len, current.micro_batch_size
            total = torch.zeros(2, dtype=torch.float64)
            module = par.module
            module.eval()
            with torch.no_grad(), autocast():
                for d in datasets.values():
                    if d.split("val").num_tokens <= seq_len * micro * rt.world_size:
                        continue
                    for x, y in validation_batches(d, seq_len, micro, rt.rank, rt.world_size, dc.val_batches):
                        out = module(x.to(rt.device), labels=y.to(rt.device))
                        total += torch.tensor([out.loss.item() * y.numel(), y.numel()], dtype=torch.float64)
            module.train()
            rt.all_reduce_sum(total)
            if total[1] == 0:
                return None
            val_loss = float(total[0] / total[1])
            metrics_log.write({"kind": "val", "step": at_step, "tokens": tokens, "val_loss": val_loss,
                               "val_ppl": perplexity(val_loss), "time": time.time()})
            say(f"step {at_step:>6}  validation loss {val_loss:.4f}  (ppl {perplexity(val_loss):.2f})")
            return val_loss

        def save(at_step: int, why: str) -> None:
            """Periodic saves run in the background (checkpoint.async_save); the final and on-signal ones block."""
            meta = {"step": at_step, "tokens": tokens, "loader": loader.state_dict(), "rng": _rng_state(),
                    "model_config": model_config, "world_size": rt.world_size, "parallel": tc.parallel,
                    "reason": why, "time": time.time()}
            try:
                store.save(at_step, par.module, optimizers, meta, blocking=None if why == "periodic" else True,
                           ram_copy=why != "final")
            except CheckpointError as err:
                raise TrainingError(str(err)) from None

        # --- the loop -----------------------------------------------------------------------------------------
        model.train()
        first_val = evaluate(step) if step == 0 and tc.eval_every > 0 else None
        losses: list[float] = []
        skipped_in_a_row = 0
        last_saved = step if start_path is not None else -1
        val_loss = first_val
        schedule_done = False
        train_seconds = 0.0
        while step < tc.max_steps:
            t0 = time.perf_counter()
            stage = _stage_at(stages, loader.state_dict())
            if stage is None:
                schedule_done = True
                break
            if config.stages:
                _set_rope_theta(model, config.stages[stages.index(stage)].rope_theta or mc.rope_theta)
            step_tokens = global_batch_tokens(tokens, tc.global_batch_tokens
                                              or stage.micro_batch_size * stage.seq_len * rt.world_size,
                                              tc.batch_ramp)
            accum = accumulation_steps(step_tokens, stage.micro_batch_size, stage.seq_len, rt.world_size)
            set_lr(optimizers, peaks, lr_factor(step, oc, oc.schedule_steps or tc.max_steps))
            loss_sum = torch.zeros((), dtype=torch.float64)
            counts = None
            consumed = 0
            for i in range(accum):
                try:
                    batch = next(loader)
                except StopIteration:
                    schedule_done = True
                    break
                with par.accumulating(is_last=(i == accum - 1)), autocast():
                    out = par.module(batch.input_ids.to(rt.device), labels=batch.labels.to(rt.device),
                                     position_ids=None if batch.position_ids is None
                                     else batch.position_ids.to(rt.device))
                    (out.loss / accum).backward()
                loss_sum += out.loss.detach().double().cpu() / accum
                counts = out.tokens_per_expert.detach().cpu() if counts is None \
                    else counts + out.tokens_per_expert.detach().cpu()
                consumed += batch.global_tokens
            if schedule_done:
                model.zero_grad(set_to_none=True)
                break
            tokens += consumed
            loss = float(rt.all_reduce_sum(loss_sum.clone())) / rt.world_size
            grad_norm = _clip(par, model, oc.grad_clip)
            finite = torch.tensor([float(math.isfinite(loss) and math.isfinite(grad_norm))])
            finite = bool(rt.all_reduce_max(1 - finite) == 0)
            global_counts = rt.all_reduce_sum(counts.double().clone())
            load = expert_load_stats(global_counts, mc.num_experts)
            if not finite:
                model.zero_grad(set_to_none=True)
                newest = latest_checkpoint(checkpoints)
                detail = (f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step {step + 1} "
                          f"(loss {loss}, grad norm {grad_norm}, stage {stage.name}); expert load max/mean per "
                          f"layer {load['expert_load_max_over_mean']}, skip share {load['skip_fraction']}")
                if tc.on_nan == "skip" and skipped_in_a_row < tc.max_skipped_steps:
                    skipped_in_a_row += 1
                    say(f"warning: {detail}; batch skipped ({skipped_in_a_row} in a row)")
                    step += 1
                    metrics_log.write({"kind": "train", "step": step, "skipped": True, "loss": loss,
                                       "tokens": tokens, "time": time.time()})
                    continue
                raise TrainingError(f"{detail}. Last good checkpoint: {newest or 'none'}. Lower optim.lr, or set "
                                    "train.on_nan = \"skip\" to skip such batches")
            skipped_in_a_row = 0
            for opt in optimizers:
                opt.step()
            # Every gradient, not only the optimizers' own: under zero1 a rank's optimizers hold only the
            # parameters it owns, and a stale gradient elsewhere would skew the next step's clipping norm.
            model.zero_grad(set_to_none=True)
            par.after_step()
            update_balancing_biases(model, counts)
            step += 1
            losses.append(loss)
            elapsed = time.perf_counter() - t0
            train_seconds += elapsed
            flops_per_token = 3 * sum(forward_flops_per_token(mc, stage.seq_len // 2).values())
            tok_s = consumed / elapsed
            record = {"kind": "train", "step": step, "loss": loss, "lr": optimizers[-1].param_groups[0]["lr"],
                      "grad_norm": grad_norm, "tokens": tokens, "tokens_per_s": tok_s, "step_time_s": elapsed,
                      "mfu": flops_per_token * tok_s / (peak * rt.world_size), "stage": stage.name,
                      "seq_len": stage.seq_len, "global_batch_tokens": consumed, "accumulation": accum,
                      **load, "time": time.time()}
            metrics_log.write(record)
            progress.step(record)

            flags = rt.all_reduce_max(torch.tensor([float(stopper.requested), float(store.poll_failed())]))
            if flags[1] > 0:
                failed = store.fatal or store.last_outcome
                raise TrainingError(f"checkpoint of step {failed.step if failed else '?'} failed"
                                    f"{': ' + failed.error if failed else ' on another rank'}; stopping "
                                    f'(checkpoint.on_error = "stop"). The newest checkpoint is '
                                    f"{latest_checkpoint(checkpoints) or 'none'}")
            stop_now = bool(flags[0] > 0)
            if tc.eval_every and step % tc.eval_every == 0 and step < tc.max_steps:
                val_loss = evaluate(step)
            if stop_now:
                save(step, f"stop requested ({stopper.signal_name or 'signal on another rank'})")
                last_saved = step
                say(f"stopped at step {step} on request; resume with the same command")
                break
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step < tc.max_steps:
                save(step, "periodic")
                last_saved = step

        finished = step >= tc.max_steps or schedule_done
        if schedule_done:
            say(f"the data schedule ended after {tokens:,} tokens (step {step})")
        if finished:
            val_loss = evaluate(step)
            if last_saved != step:
                save(step, "final")
            else:
                store.wait()
            store.forget_ram_tier()  # a finished run needs no crash-restart copy in host memory
        summary = {"step": step, "tokens": tokens, "first_val_loss": first_val, "val_loss": val_loss,
                   "first_loss": losses[0] if losses else None, "final_loss": float(np.mean(losses[-10:]))
                   if losses else None, "tokens_per_s": (tokens - start_tokens) / train_seconds
                   if train_seconds else None, "run_dir": str(run_dir),
                   "checkpoint": str(latest_checkpoint(checkpoints) or ""), "finished": finished,
                   "resumed_from": resumed_from}
        if finished and rt.is_main:
            _finish(config, par, model, run_dir, summary, say, first, autocast)
        return summary
    finally:
        if store is not None:
            store.close()
        stopper.uninstall()
        progress.close()
        if loader is not None:
            loader.close()
        if metrics_log is not None:
            metrics_log.close()
        stop(rt)


def _stage_at(stages, state: dict[str, Any]):
    """The stage the loader's next micro-batch falls in (None when the schedule is over)."""
    index, done = state["stage"], state["stage_tokens"]
    while index < len(stages) and stages[index].tokens and done >= stages[index].tokens:
        index, done = index + 1, 0
    return stages[index] if index < len(stages) else None


def _clip(par, model, max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards under FSDP); return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _finish(config: Config, par, model, run_dir: Path, summary: dict[str, Any], say, dataset, autocast) -> None:
    """Rank 0 after the final checkpoint: plots and a generated sample."""
    tc = config.train
    try:
        from zaya.train.plot import plot_run

        paths = plot_run(run_dir)
        summary["plots"] = [str(p) for p in paths]
        say(f"plots: {', '.join(str(p) for p in paths)}")
    except Exception as exc:  # plots are a convenience; never fail a finished run over them
        say(f"warning: could not write plots ({exc})")
    if tc.sample_prompt and tc.sample_tokens > 0:
        if par.mode == "fsdp" and par.runtime.distributed:
            say("sample: skipped under FSDP (run `zaya generate --checkpoint RUN_DIR`)")
            return
        tokenizer = dataset.tokenizer()
        prompt = torch.tensor([[config.model.eos_token_id] + tokenizer.encode(tc.sample_prompt)],
                              device=par.runtime.device)
        model.eval()
        with torch.no_grad(), autocast():
            out = model.generate(prompt, max_new_tokens=tc.sample_tokens, temperature=0.8, top_k=40,
                                 seed=tc.seed)
        sample = tokenizer.decode(out[0, 1:].tolist())
        summary["sample"] = sample
        say("--- sample ---")
        say(sample)
        say("--------------")
