"""Mean next-token loss and perplexity of a model over a prepared dataset split (``zaya eval``)."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Any

import torch


def evaluate_loss(model, dataset, seq_len: int, batch_size: int = 8, max_batches: int | None = None,
                  split: str = "val", dtype: str = "bfloat16") -> dict[str, Any]:
    """Token-weighted mean loss over the split's packed sequences, in order (no shuffle), one process."""
    from zaya.data.loader import validation_batches

    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    total, count, batches = 0.0, 0, 0
    start = time.perf_counter()
    with torch.no_grad(), autocast:
        for x, y in validation_batches(dataset, seq_len, batch_size, max_batches=max_batches, split=split):
            out = model(x.to(device), labels=y.to(device))
            total += float(out.loss) * y.numel()
            count += y.numel()
            batches += 1
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else float("inf"), "tokens": count,
            "batches": batches, "seq_len": seq_len, "split": split, "seconds": time.perf_counter() - start}
