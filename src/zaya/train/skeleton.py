"""The walking-skeleton trainer: a ZAYA1-style MoE on prepared token bundles (the built-in corpus by default), CPU.

One file, one loop, no distributed code: it proves the model learns and exercises the whole path (config -> data
(tokenizer, bundles, packed loader) -> model -> loss -> AdamW -> balancing biases -> checkpoint -> sampling). The
full trainer (Muon, DDP/FSDP, resumable checkpoints, stages) replaces it.
"""

from __future__ import annotations

import json
import math
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from zaya.config import Config, DataConfig

METRICS_FILE = "metrics.json"
CHECKPOINT_SUBDIR = "model"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (>= 2-D, stacked expert weights included), never on embeddings."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine decay to peak/10."""
    if step < warmup:
        return peak * (step + 1) / warmup
    floor = peak / 10
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def _console():
    try:
        from rich.console import Console

        return Console(highlight=False)
    except ImportError:  # rich is a dependency, but the loop must not need it
        return None


def _say(console, text: str, style: str | None = None) -> None:
    if console is None:
        print(text, flush=True)
    else:
        console.print(text, style=style, markup=False, soft_wrap=True)


def _check_checkpoint_dir(path: Path) -> None:
    """Saving replaces the checkpoint directory whole: refuse when it holds something other than a checkpoint."""
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / "zaya.json").is_file())):
        raise FileExistsError(f"{path} exists and is not a zaya checkpoint; choose another --out")


def open_datasets(dc: DataConfig, log=print) -> dict:
    """``data.datasets`` as opened PreparedDatasets (built-in corpora prepared on first use)."""
    from zaya.data.bundle import PreparedDataset
    from zaya.data.cache import resolve_dataset

    return {name: PreparedDataset(resolve_dataset(spec, dc.builtin_vocab_size, dc.cache_dir, log=log))
            for name, spec in dc.datasets.items()}


def train(config: Config) -> dict[str, Any]:
    """Train ``config.model`` on ``config.data`` per ``config.train``; return the metrics.

    Writes ``<train.out_dir>/model/`` (a zaya checkpoint: ``zaya.load_pretrained`` reads it) and
    ``<train.out_dir>/metrics.json``.

    The returned (and saved) metrics: ``first_loss`` (step 1), ``final_loss`` (mean of the last 10 steps' losses),
    ``val_loss`` (the datasets' validation splits), ``steps``, ``tokens_per_s`` (training only), the sample text.
    """
    from zaya.config import dump_config
    from zaya.model import ZayaForCausalLM, save_checkpoint, update_balancing_biases

    from zaya.data.loader import DataLoader, Stage, check_vocabulary, validation_batches

    tc, mc, dc = config.train, config.model, config.data
    out_dir = Path(tc.out_dir)
    checkpoint_dir = out_dir / CHECKPOINT_SUBDIR
    _check_checkpoint_dir(checkpoint_dir)
    console = _console()

    datasets = open_datasets(dc, log=lambda m: _say(console, m))
    for dataset in datasets.values():
        check_vocabulary(dataset, mc.vocab_size, mc.eos_token_id)
    tokenizer = next(iter(datasets.values())).tokenizer()
    loader = DataLoader(datasets, [Stage("main", tc.seq_len, tc.batch_size, dc.mixture())], seed=dc.seed,
                        document_positions=dc.document_positions, prefetch=dc.prefetch)

    seed_everything(tc.seed)
    model = ZayaForCausalLM(mc)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay)
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if tc.dtype == "bfloat16" else nullcontext()

    tokens_per_step = tc.batch_size * tc.seq_len
    train_tokens = sum(d.split("train").num_tokens for d in datasets.values())
    _say(console, f"zaya skeleton: {n_params:,} parameters, {train_tokens:,} train tokens "
                  f"({', '.join(datasets)}), {tc.steps} steps x {tokens_per_step:,} tokens, dtype {tc.dtype}, "
                  f"{torch.get_num_threads()} threads", style="bold")

    losses: list[float] = []
    model.train()
    start = interval_start = time.perf_counter()
    last_logged = 0
    for step in range(tc.steps):
        lr = lr_at(step, tc.lr, tc.warmup_steps, tc.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(loader)
        with autocast():
            out = model(batch.input_ids, labels=batch.labels, position_ids=batch.position_ids)
        out.loss.backward()
        if tc.grad_clip > 0:
            grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip))
        else:
            grad_norm = float(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = update_balancing_biases(model, out.tokens_per_expert)
        loss = out.loss.item()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {step + 1}; try a lower train.lr")
        losses.append(loss)

        done = step + 1
        if done == 1 or done % tc.log_every == 0 or done == tc.steps:
            now = time.perf_counter()
            tok_s = (done - last_logged) * tokens_per_step / max(now - interval_start, 1e-9)
            interval_start, last_logged = now, done
            _say(console, f"step {done:>5}/{tc.steps}  loss {loss:.4f}  lr {lr:.2e}  grad {grad_norm:.2f}  "
                          f"imbalance {float(imbalance.max()):.2f}  {tok_s:,.0f} tok/s")
    elapsed = time.perf_counter() - start
    loader.close()

    model.eval()
    val_losses = []
    with torch.no_grad(), autocast():
        for dataset in datasets.values():
            for inputs, targets in validation_batches(dataset, tc.seq_len, tc.batch_size,
                                                      max_batches=dc.val_batches):
                val_losses.append(model(inputs, labels=targets).loss.item())
    val_loss = sum(val_losses) / len(val_losses)

    # Documents follow an eos in the packed stream, so a prompt that starts a document starts after one.
    prompt = torch.tensor([[mc.eos_token_id] + tokenizer.encode(tc.sample_prompt)])
    with autocast():
        generated = model.generate(prompt, max_new_tokens=tc.sample_tokens, temperature=0.8, top_k=40,
                                   seed=tc.seed)
    sample = tokenizer.decode(generated[0, 1:].tolist())

    tail = losses[-min(10, len(losses)):]
    metrics = {
        "steps": tc.steps,
        "params": n_params,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "val_loss": val_loss,
        "tokens_per_s": tc.steps * tokens_per_step / elapsed,
        "train_seconds": elapsed,
        "checkpoint": str(checkpoint_dir),
        "sample": sample,
    }
    save_checkpoint(model, checkpoint_dir)
    dump_config(config, out_dir / "config.toml")
    (out_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")

    _say(console, f"validation loss {val_loss:.4f} (first train loss {losses[0]:.4f}, "
                  f"final {metrics['final_loss']:.4f}); {metrics['tokens_per_s']:,.0f} tok/s", style="bold")
    _say(console, "--- sample ---", style="dim")
    _say(console, sample)
    _say(console, "--------------", style="dim")
    _say(console, f"checkpoint: {checkpoint_dir}/  metrics: {out_dir / METRICS_FILE}", style="bold")
    return metrics
