"""Bias balancing: ``update_balancing_biases`` takes the step's global counts (the caller sums them over micro-batches
and data-parallel ranks), runs no collective and reads nothing back to the host, and takes the same Adam step as the
host-side reference below."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from model_helpers import tiny_config, tiny_model
from zaya.distributed.checks import HostReads
from zaya.model import ZayaForCausalLM, update_balancing_biases

CFG = dict(vocab_size=32, hidden_size=16, num_query_heads=2, head_dim=8, expert_hidden_size=8, router_hidden_size=8,
           router_balance_lr=0.01, router_balancing="adamw")


def routers(model):
    return [b.moe.router for b in model.blocks]


@torch.no_grad()
def reference_update(model, counts) -> list[float]:
    """The update as it was written with host-side scalars (one layer at a time, Python floats)."""
    cfg = model.config
    beta1, beta2 = cfg.router_balance_betas
    imbalance = []
    for router, layer_counts in zip(routers(model), counts.double()):
        e = router.num_experts
        real = layer_counts[:e]
        total = float(real.sum())
        if total <= 0:
            imbalance.append(float("nan"))
            continue
        f = real / total
        imbalance.append(float(f.max() * e))
        g = (f - 1.0 / e).float()
        router.balance_step += 1
        step = float(router.balance_step)
        router.balance_exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
        router.balance_exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m_hat = router.balance_exp_avg / (1 - beta1**step)
        v_hat = router.balance_exp_avg_sq / (1 - beta2**step)
        router.balancing_biases[:e] -= cfg.router_balance_lr * m_hat / (v_hat.sqrt() + cfg.router_balance_eps)
    return imbalance


def test_update_with_summed_counts_equals_the_host_side_math(monkeypatch):
    def no_collectives(*args, **kwargs):
        raise AssertionError("update_balancing_biases ran a collective")

    monkeypatch.setattr(dist, "all_reduce", no_collectives)
    got = tiny_model(**CFG)
    want = ZayaForCausalLM(tiny_config(**CFG))
    want.load_state_dict(got.state_dict())
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        per_rank = torch.randint(0, 40, (2, 3, 5), generator=g)  # [ranks, layers, classes]
        if step % 5 == 0:
            per_rank[:, 1, :4] = 0  # a layer whose experts got nothing (all skipped) this step
        counts = per_rank.sum(0)  # the caller's reduction over ranks
        with HostReads() as reads:
            imbalance = update_balancing_biases(got, counts)
        assert reads.total == 0, reads.report()
        expected = reference_update(want, counts)
        assert imbalance.dtype == torch.float32 and imbalance.shape == (3,)
        torch.testing.assert_close(imbalance, torch.tensor(expected), equal_nan=True, rtol=0, atol=0)
        for a, b in zip(got.buffers(), want.buffers()):
            assert torch.equal(a, b)
    assert [float(r.balance_step) for r in routers(got)] == [60, 48, 60]


def test_skip_bias_is_untouched_and_overloaded_expert_pushed_down():
    model = tiny_model(**CFG)
    before = [r.balancing_biases.clone() for r in routers(model)]
    counts = torch.tensor([[10, 2, 2, 2, 5], [4, 4, 4, 4, 9], [1, 2, 3, 4, 0]])
    imbalance = update_balancing_biases(model, counts)
    after = [r.balancing_biases for r in routers(model)]
    for b, a in zip(before, after):
        assert a[4] == b[4] == -1.0  # the skip class's bias
    assert after[0][0] < 0 < after[0][1]
    assert torch.equal(after[1], before[1])  # balanced: g = 0
    lr, eps = CFG["router_balance_lr"], tiny_config(**CFG).router_balance_eps
    g = torch.tensor([0.1, 0.2, 0.3, 0.4]) - 0.25
    torch.testing.assert_close(after[2][:4], -lr * g / (g.abs() + eps))  # first Adam step: -lr * sign(g)
    assert math.isclose(float(imbalance[0]), 10 / 16 * 4, rel_tol=1e-6)
    assert math.isclose(float(imbalance[1]), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("rule", ["adaptive", "adamw"])
def test_layer_with_no_routed_tokens_is_left_unchanged(rule):
    model = tiny_model(**{**CFG, "router_balancing": rule})
    update_balancing_biases(model, torch.tensor([[9, 1, 3, 3, 0]] * 3))  # moments and steps away from zero
    state = {k: v.clone() for k, v in model.state_dict().items() if "balanc" in k}
    imbalance = update_balancing_biases(model, torch.tensor([[5, 1, 1, 1, 2], [0, 0, 0, 0, 7], [0, 0, 0, 0, 0]]))
    assert torch.isnan(imbalance[1:]).all() and not torch.isnan(imbalance[0])
    for k, v in model.state_dict().items():
        if "balanc" in k and not k.startswith("blocks.0."):
            assert torch.equal(v, state[k]), k
    assert not torch.equal(model.blocks[0].moe.router.balancing_biases, state["blocks.0.moe.router.balancing_biases"])
    assert all(torch.isfinite(r.balancing_biases).all() for r in routers(model))


# ----------------------------------------------------------------------------------------------- adaptive rule
ADAPTIVE = {**CFG, "router_balancing": "adaptive", "router_balance_step": 1e-3, "router_balance_step_max": 4e-3,
            "router_balance_step_min": 1e-4}


@torch.no_grad()
def reference_adaptive(router, counts: torch.Tensor, cfg: ModelConfig) -> None:
    """The adaptive rule written out per expert with Python floats."""
    e = router.num_experts
    real = [float(c) for c in counts[:e]]
    if sum(real) <= 0:
        return
    for i in range(e):
        error = real[i] / sum(real) * e - 1.0
        last = float(router.balance_last_error[i])
        step = float(router.balance_step_size[i])
        step *= 0.5 if error * last < 0 else 1.2 if error * last > 0 else 1.0
        step = min(max(step, cfg.router_balance_step_min), cfg.router_balance_step_max)
        router.balancing_biases[i] -= step * max(-1.0, min(1.0, error))
        router.balance_step_size[i] = step
        router.balance_last_error[i] = error


def test_adaptive_update_equals_the_per_expert_reference_and_reads_nothing():
    torch.manual_seed(0)
    cfg = tiny_config(**ADAPTIVE)
    got, want = ZayaForCausalLM(cfg), ZayaForCausalLM(cfg)
    want.load_state_dict(got.state_dict())
    g = torch.Generator().manual_seed(1)
    for step in range(40):
        counts = torch.randint(0, 30, (3, 5), generator=g)
        if step % 7 == 0:
            counts[2, :4] = 0  # nothing routed in layer 2: left as it is
        with HostReads() as reads:
            update_balancing_biases(got, counts)
        assert reads.total == 0, reads.report()
        for router, layer_counts in zip(routers(want), counts):
            reference_adaptive(router, layer_counts, cfg)
        for (name, a), b in zip(got.named_buffers(), want.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)  # fp32 against Python floats
    sizes = torch.stack([r.balance_step_size for r in routers(got)])
    assert sizes.min() >= 1e-4 and sizes.max() <= 4e-3 and sizes.unique().numel() > 2  # grown, shrunk, clamped


def test_adaptive_step_is_scaled_by_the_error_and_halves_on_a_sign_change():
    model = ZayaForCausalLM(tiny_config(**ADAPTIVE))
    router = routers(model)[0]
    update_balancing_biases(model, torch.tensor([[8, 4, 2, 2, 0], [4, 4, 4, 4, 0], [4, 4, 4, 4, 0]]))
    # errors E*f - 1 = [1, 0, -0.5, -0.5]: steps of 1e-3 scaled by the error
    torch.testing.assert_close(router.balancing_biases[:4], torch.tensor([-1e-3, 0.0, 5e-4, 5e-4]))
    update_balancing_biases(model, torch.tensor([[2, 4, 8, 2, 0], [4, 4, 4, 4, 0], [4, 4, 4, 4, 0]]))
    # expert 0 and 2 changed sign (halved), 3 kept it (grown by 1.2x), 1 had no error (unchanged)
    torch.testing.assert_close(router.balance_step_size, torch.tensor([5e-4, 1e-3, 5e-4, 1.2e-3]))
    assert router.balancing_biases[4] == -1.0  # the skip class is never moved


def near_uniform_router_run(rule: str, steps: int = 300, tokens: int = 2048) -> list[float]:
    """Balancing against an untrained router: fixed expert preferences and per-token probabilities that differ by
    about 1e-3 (what the tiny model's routers give at the start), fresh tokens every step."""
    cfg = tiny_config(**{**CFG, "num_layers": 1, "num_experts": 8, "router_skip_expert": False,
                         "router_balancing": rule, "router_balance_lr": 1e-2})
    model = ZayaForCausalLM(cfg)
    router = routers(model)[0]
    g = torch.Generator().manual_seed(0)
    preference = 0.03 * torch.randn(8, generator=g)
    ratios = []
    for _ in range(steps):
        probs = torch.softmax(preference + 0.01 * torch.randn(tokens, 8, generator=g), -1)
        chosen, _ = router.choose(probs)
        counts = torch.bincount(chosen[:, 0], minlength=8)
        ratios.append(float(counts.max() / counts.float().mean()))
        update_balancing_biases(model, counts[None])
    return ratios


def test_adaptive_rule_settles_where_the_fixed_size_step_keeps_flipping():
    adaptive, adamw = near_uniform_router_run("adaptive"), near_uniform_router_run("adamw")
    late_adaptive, late_adamw = adaptive[100:], adamw[100:]
    # Sampling noise alone gives max/mean ~1.1-1.25 for 2,048 tokens over 8 experts.
    assert max(late_adaptive) < 1.4 and sum(late_adaptive) / len(late_adaptive) < 1.2
    assert sum(late_adamw) / len(late_adamw) > sum(late_adaptive) / len(late_adaptive) + 0.15
