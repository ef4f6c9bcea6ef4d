"""The walking-skeleton trainer: a ZAYA1-style MoE byte model on the built-in Shakespeare corpus, on CPU.

One file, one loop, no distributed code: it proves the model learns and exercises the whole path (config ->
model -> loss -> AdamW -> balancing biases -> checkpoint -> sampling). The full trainer (Muon, bundles, DDP/FSDP,
resumable checkpoints) replaces it.
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

from zaya.config import Config, ConfigError
from zaya.data.corpus import ByteTokenizer, load_corpus_text

VAL_FRACTION = 0.05
VAL_BATCHES = 8
SAMPLE_PROMPT = "**ROMEO**  \n"
METRICS_FILE = "metrics.json"
CHECKPOINT_SUBDIR = "model"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def byte_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus as byte tokens (uint8), split into train and the held-out last 5% for validation."""
    data = torch.frombuffer(bytearray(load_corpus_text().encode("utf-8")), dtype=torch.uint8)
    split = int(len(data) * (1 - VAL_FRACTION))
    return data[:split], data[split:]


def random_batch(data: torch.Tensor, batch_size: int, seq_len: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random contiguous windows of ``seq_len + 1`` tokens -> (inputs, next-token targets)."""
    if len(data) < seq_len + 1:
        raise ConfigError(f"train.seq_len = {seq_len}: longer than the data split ({len(data)} tokens)")
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


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


def train(config: Config) -> dict[str, Any]:
    """Train ``config.model`` on byte tokens per ``config.train``; return the metrics.

    Writes ``<train.out_dir>/model/`` (a zaya checkpoint: ``zaya.load_pretrained`` reads it) and
    ``<train.out_dir>/metrics.json``.

    The returned (and saved) metrics: ``first_loss`` (step 1), ``final_loss`` (mean of the last 10 steps' losses),
    ``val_loss`` (held-out last 5% of the corpus), ``steps``, ``tokens_per_s`` (training only), the sample text.
    """
    from zaya.config import dump_config
    from zaya.model import ZayaForCausalLM, save_checkpoint, update_balancing_biases

    tc, mc = config.train, config.model
    tokenizer = ByteTokenizer()
    if mc.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size = {mc.vocab_size}: the walking-skeleton trainer uses byte tokens, "
                          f"so model.vocab_size must be >= {tokenizer.vocab_size}")
    out_dir = Path(tc.out_dir)
    checkpoint_dir = out_dir / CHECKPOINT_SUBDIR
    _check_checkpoint_dir(checkpoint_dir)
    console = _console()

    seed_everything(tc.seed)
    train_data, val_data = byte_corpus()
    model = ZayaForCausalLM(mc)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay)
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if tc.dtype == "bfloat16" else nullcontext()

    generator = torch.Generator().manual_seed(tc.seed)
    tokens_per_step = tc.batch_size * tc.seq_len

    _say(console, f"zaya skeleton: {n_params:,} parameters, {len(train_data):,} train / {len(val_data):,} val "
                  f"bytes, {tc.steps} steps x {tokens_per_step:,} tokens, dtype {tc.dtype}, "
                  f"{torch.get_num_threads()} threads", style="bold")

    losses: list[float] = []
    model.train()
    start = interval_start = time.perf_counter()
    last_logged = 0
    for step in range(tc.steps):
        lr = lr_at(step, tc.lr, tc.warmup_steps, tc.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = random_batch(train_data, tc.batch_size, tc.seq_len, generator)
        with autocast():
            out = model(inputs, labels=targets)
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

    model.eval()
    val_generator = torch.Generator().manual_seed(tc.seed + 1)
    val_losses = []
    with torch.no_grad(), autocast():
        for _ in range(VAL_BATCHES):
            inputs, targets = random_batch(val_data, tc.batch_size, tc.seq_len, val_generator)
            val_losses.append(model(inputs, labels=targets).loss.item())
    val_loss = sum(val_losses) / len(val_losses)

    prompt = torch.tensor([tokenizer.encode(SAMPLE_PROMPT)])
    with autocast():
        generated = model.generate(prompt, max_new_tokens=tc.sample_tokens, temperature=0.8, top_k=40,
                                   seed=tc.seed)
    sample = tokenizer.decode(generated[0].tolist())

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
