"""Routing health: the load statistics of a step, the routing probe (flip rate, token entropy), the Switch-style
auxiliary loss of the ablation's baseline, and the trainer logging all of it without another host read."""

from __future__ import annotations

import math

import pytest
import torch

from model_helpers import tiny_config, tiny_model
from zaya.distributed.checks import HostReads
from zaya.model import ZayaForCausalLM
from zaya.model.moe import switch_balancing_loss
from zaya.model.router import routers_of
from zaya.train.metrics import expert_load_stats
from zaya.train.routing_probe import RoutingProbe

CFG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_query_heads=2, expert_hidden_size=16, max_seq_len=32)


def test_load_stats_per_layer_against_hand_computed_values():
    stats = expert_load_stats([[4, 4, 4, 4, 0], [8, 0, 0, 0, 8], [0, 0, 0, 0, 5]], num_experts=4)
    assert stats["expert_load_max_over_mean"] == [1.0, 4.0, None]
    assert stats["expert_load_cv"][0] == 0.0
    assert stats["expert_load_cv"][1] == pytest.approx(math.sqrt(3), abs=1e-4)  # one of 4 takes all: std/mean
    assert stats["expert_load_entropy"][:2] == [1.0, 0.0] and stats["expert_load_entropy"][2] is None
    assert stats["skip_fraction"] == [0.0, 0.5, 1.0]
    assert stats["expert_load"][1] == [0.5, 0.0, 0.0, 0.0, 0.5]
    two = expert_load_stats([[3, 1]], num_experts=2)["expert_load_entropy"][0]
    assert two == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2), abs=1e-4)


def test_probe_flip_rate_counts_tokens_whose_top_choice_moved():
    model = tiny_model(**CFG, router_skip_expert=False)
    ids = torch.randint(0, 64, (1, 32))
    probe = RoutingProbe(ids, num_layers=2)
    routers = routers_of(model)
    with HostReads() as reads:
        first, compared = probe.measure(model, routers, torch.no_grad)
    assert reads.total == 0, reads.report()
    assert not compared and first.shape == (4,) and torch.equal(first[:2], torch.zeros(2, dtype=torch.float64))
    assert ((0 < first[2:]) & (first[2:] <= 1)).all()  # normalised token entropy
    again, compared = probe.measure(model, routers, torch.no_grad)
    assert compared and torch.equal(again, first)  # nothing changed: no flips, same entropy
    before = probe._previous.clone()
    with torch.no_grad():
        routers[1].balancing_biases[3] = 10.0  # layer 1: every token now picks expert 3
    moved, _ = probe.measure(model, routers, torch.no_grad)
    assert moved[0] == 0.0
    assert moved[1] == pytest.approx(float((before[1] != 3).double().mean()))


def test_switch_loss_is_one_when_uniform_and_leaves_padding_out():
    probs = torch.full((8, 5), 0.2)
    counts = torch.tensor([2, 2, 2, 2, 0])
    assert float(switch_balancing_loss(probs[:, :], counts, 4)) == pytest.approx(4 * 4 * 0.25 * 0.2)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 4 + [[0.0, 0.0, 0.0, 1.0]] * 4, requires_grad=True)
    valid = torch.tensor([[1.0]] * 4 + [[0.0]] * 4)  # the last four rows are padding
    loss = switch_balancing_loss(skewed, torch.tensor([4, 0, 0, 0]), 4, valid)
    assert float(loss.detach()) == pytest.approx(4 * 1.0 * 0.7)  # f = (1, 0, 0, 0), P over the real rows only
    loss.backward()
    assert skewed.grad[:4, 0].gt(0).all() and skewed.grad[4:].abs().sum() == 0


def test_model_returns_the_aux_loss_only_when_asked_and_training():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    plain = ZayaForCausalLM(tiny_config(**CFG))
    assert plain(ids, labels=ids).aux_loss is None
    model = ZayaForCausalLM(tiny_config(**CFG, router="linear", router_aux_loss_coef=0.01,
                                        router_balancing="none"))
    out = model(ids, labels=ids)
    assert out.aux_loss is not None and 0.01 * 2 * 0.99 < float(out.aux_loss.detach()) < 0.01 * 2 * 4
    out.aux_loss.backward()
    assert all(r.proj.weight.grad is not None and r.proj.weight.grad.abs().sum() > 0 for r in routers_of(model))
    with torch.no_grad():
        assert model(ids).aux_loss is None  # evaluation and decoding never compute it


def test_trainer_logs_routing_health_inside_its_read_budget(tmp_path, micro_config):
    from zaya.distributed.runtime import Runtime
    from zaya.config import load_config
    from zaya.train.step import HOST_READS_PER_STEP
    from zaya.train.trainer import Trainer

    trainer = Trainer.build(load_config(micro_config(tmp_path / "run"), []), Runtime(), resume="never")
    try:
        first = trainer.step()
        with HostReads() as reads:
            second = trainer.step()
    finally:
        trainer.close()
    assert reads.total <= HOST_READS_PER_STEP, reads.report()
    layers = trainer.config.model.num_layers
    assert first["router_flip_rate"] is None  # no previous step to compare with
    assert len(second["router_flip_rate"]) == layers and all(0 <= v <= 1 for v in second["router_flip_rate"])
    assert all(0 < v <= 1 for v in second["router_token_entropy"])
    for key in ("expert_load_max_over_mean", "expert_load_cv", "expert_load_entropy", "skip_fraction"):
        assert len(second[key]) == layers, key


def test_aux_loss_training_logs_the_language_model_loss(tmp_path, micro_config):
    """With the auxiliary loss on, the logged loss is still the cross-entropy (same first-step loss as without)."""
    from zaya.distributed.runtime import Runtime
    from zaya.config import load_config
    from zaya.train.trainer import Trainer

    losses = []
    for extra in ([], ["model.router_aux_loss_coef=0.5"]):
        trainer = Trainer.build(load_config(micro_config(tmp_path / f"run{len(extra)}"),
                                            ['model.router="linear"', *extra]), Runtime(), resume="never")
        try:
            losses.append([trainer.step()["loss"], trainer.step()["loss"]])
        finally:
            trainer.close()
    assert losses[0][0] == losses[1][0]  # the same weights and batch: the same cross-entropy
    assert losses[0][1] != losses[1][1]  # but the auxiliary loss moved the weights differently


def test_weights_saved_before_the_adaptive_rule_existed_still_load():
    """A zaya state dict without the adaptive rule's buffers (files of earlier versions) loads, the rule's state
    fresh and everything stored exactly as stored."""
    from zaya.model.io import build_from_state_dict

    torch.manual_seed(0)
    cfg = tiny_config(**CFG)
    model = ZayaForCausalLM(cfg)
    with torch.no_grad():
        for router in routers_of(model):
            router.balancing_biases[:2] = 0.25
            router.balance_step_size.fill_(0.02)
    old = {k: v for k, v in model.state_dict().items() if not k.endswith(("balance_step_size", "balance_last_error"))}
    loaded = build_from_state_dict(cfg, old, "old.safetensors")
    for name, value in loaded.state_dict().items():
        if name.endswith("balance_step_size"):
            assert torch.equal(value, torch.full_like(value, cfg.router_balance_step)), name
        elif name.endswith("balance_last_error"):
            assert not value.any(), name
        elif name in old:
            assert torch.equal(value, old[name]), name
    with pytest.raises(ValueError, match="balancing_biases' is missing"):  # a weight still may not be absent
        build_from_state_dict(cfg, {k: v for k, v in old.items() if not k.endswith("balancing_biases")}, "x")
