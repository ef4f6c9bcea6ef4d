"""Next-token loss and perplexity of a model over a prepared dataset split: ``zaya eval``, and the trainer's
validation (one code path for both).

The loss is token-weighted: the sum of every target's loss over the number of targets, accumulated on the device
(no host read per batch) and, under a runtime with several data-parallel ranks, summed over them before the one
division; never a mean of per-batch or per-rank means.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from zaya.core.device import autocast
from zaya.model.loss import IGNORE_INDEX


def loss_totals(model: torch.nn.Module, dataset, seq_len: int, batch_size: int, max_batches: int | None = None,
                split: str = "val", dtype: str = "bfloat16", runtime=None, document_positions: bool = False,
                document_mask: bool = False) -> tuple[torch.Tensor, int]:
    """([loss sum, target count] as a float64 device tensor, batches) over this rank's share of the split (every
    dp-th batch under ``runtime``), not reduced over ranks. Runs in eval mode without gradients. Targets a loss mask
    excludes are not counted; position ids restart per document with ``document_positions`` (training's
    ``data.document_positions``), and attention stays inside a document with ``document_mask`` or on data with
    loss masks (chat data is trained that way)."""
    from zaya.data.loader import validation_batches

    device = runtime.device if runtime is not None else next(model.parameters()).device
    rank, world = (runtime.dp_rank, runtime.dp_size) if runtime is not None else (0, 1)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    batches = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, dtype):
            for x, y, pos in validation_batches(dataset, seq_len, batch_size, rank, world, max_batches, split,
                                                document_positions or document_mask):
                move = runtime.to_device if runtime is not None else (lambda t: t.to(device))
                x, y = move(x), move(y)
                masked = pos is not None and (document_mask or not document_positions)
                out = model(x, labels=y, position_ids=None if pos is None else move(pos), document_mask=masked)
                n = (y != IGNORE_INDEX).sum().double()
                # A batch whose every label is masked has a NaN mean loss and adds nothing (no host read to skip it).
                totals[0] += torch.where(n > 0, out.loss.double() * n, torch.zeros_like(n))
                totals[1] += n
                batches += 1
    finally:
        model.train(was_training)
    return totals, batches


def evaluate_loss(model: torch.nn.Module, dataset, seq_len: int, batch_size: int = 8, max_batches: int | None = None,
                  split: str = "val", dtype: str = "bfloat16", runtime=None, document_positions: bool = False,
                  document_mask: bool = False) -> dict[str, Any]:
    """Token-weighted mean loss over the split's packed sequences, in order (no shuffle): one process, or every
    data-parallel rank of ``runtime`` its share (collective: every rank calls it)."""
    start = time.perf_counter()
    totals, batches = loss_totals(model, dataset, seq_len, batch_size, max_batches, split, dtype, runtime,
                                  document_positions, document_mask)
    if runtime is not None:
        runtime.all_reduce(totals, over="dp")
    loss_sum, count = runtime.read(totals) if runtime is not None else totals.tolist()
    loss = loss_sum / count
    world = runtime.dp_size if runtime is not None else 1
    return {"loss": loss, "perplexity": perplexity(loss), "loss_sum": loss_sum, "tokens": int(count),
            "batches": batches * world, "seq_len": seq_len, "split": split, "seconds": time.perf_counter() - start}


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")
