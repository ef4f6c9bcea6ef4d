"""Pieces of the walking-skeleton trainer that need no model: LR schedule, optimizer groups."""

import math

import pytest
import torch
from torch import nn

from zaya.train.skeleton import build_optimizer, lr_at


def test_lr_schedule_warmup_then_cosine_to_a_tenth():
    peak, warmup, total = 1e-3, 10, 100
    assert lr_at(0, peak, warmup, total) == pytest.approx(peak / warmup)
    assert lr_at(warmup - 1, peak, warmup, total) == pytest.approx(peak)
    assert lr_at(warmup, peak, warmup, total) == pytest.approx(peak)
    assert lr_at(total, peak, warmup, total) == pytest.approx(peak / 10)
    mid = warmup + (total - warmup) // 2
    assert lr_at(mid, peak, warmup, total) == pytest.approx(peak / 10 + 0.45 * peak * (1 + math.cos(math.pi / 2)))
    values = [lr_at(s, peak, warmup, total) for s in range(warmup, total)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_weight_decay_only_on_matrices_not_embeddings():
    model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "proj": nn.Linear(4, 4), "norm": nn.LayerNorm(4)})
    model.experts = nn.Parameter(torch.zeros(2, 4, 4))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert ids(decay) == {id(model["proj"].weight), id(model.experts)}
    assert id(model["embed"].weight) in ids(no_decay) and id(model["proj"].bias) in ids(no_decay)
