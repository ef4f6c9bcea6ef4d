"""The MoE dispatch as a GPU would run it: no host reads, static shapes, and what that asks of the grouped GEMMs.

- a whole training forward + backward (grouped_mm path, skip class on, CCA, fp32 and bf16 autocast) reads nothing
  back to the host (``zaya.distributed.checks.HostReads``) and creates no tensor without a device (``ExplicitDevices``);
- grouped_mm against the loop reference: outputs and every gradient (fp32 tight, bf16 loose), an expert with no
  tokens getting exactly zero weight gradients;
- ``F.grouped_mm`` leaves the rows past the last offset (the skipped assignments) and, on some GPUs, an empty
  group's weight gradient uninitialised: here it is made to write NaN there, and nothing of it may reach a result;
- the experts stay in the autograd graph when every token of a rank goes to the skip class: two DDP steps over 2
  gloo ranks, one of them routing everything to skip, end with the same parameters on both ranks.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_helpers import run_ok
from model_helpers import tiny_config, tiny_model
from zaya.config import ModelConfig
from zaya.distributed.checks import ExplicitDevices, HostReads
from zaya.model import ZayaForCausalLM
from zaya.model.moe import Experts, MoEBlock, grouped_mm_supported

pytestmark = pytest.mark.skipif(not grouped_mm_supported(torch.device("cpu"), torch.float32),
                                reason="this torch has no F.grouped_mm")


def small_config(**overrides) -> ModelConfig:
    return tiny_config(**{"num_layers": 2, "moe_impl": "grouped_mm", **overrides})


def skipping_model(cfg: ModelConfig, seed: int = 0) -> ZayaForCausalLM:
    """A model whose routers spread the tokens over every class, the skip class included (its bias raised from -1
    to 0, and router logits that differ from token to token)."""
    torch.manual_seed(seed)
    model = ZayaForCausalLM(cfg)
    with torch.no_grad():
        for block in model.blocks:
            router = block.moe.router
            router.out_proj.weight.normal_(0.0, 1.0)
            router.balancing_biases.zero_()
    return model


# ----------------------------------------------------------------------------------------------- host reads
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_training_forward_backward_reads_nothing_back(autocast, top_k):
    cfg = small_config(top_k=top_k)
    model = skipping_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with ExplicitDevices(), HostReads() as reads:  # and every tensor zaya creates says where it lives
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids, labels=ids.roll(-1, 1))
        out.loss.backward()
    assert reads.total == 0, reads.report()
    counts = out.tokens_per_expert
    assert (counts[:, cfg.num_experts] > 0).all() and (counts[:, : cfg.num_experts].sum(1) > 0).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_host_read_counter_sees_the_loop_reference():
    """The counter is not blind: the loop reference reads its counts back (one read per MoE layer)."""
    cfg = small_config(moe_impl="loop")
    model = skipping_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with HostReads() as reads:
        model(ids, labels=ids.roll(-1, 1)).loss.backward()
    assert reads.total == cfg.num_layers, reads.report()


# ----------------------------------------------------------------------------------------------- grouped_mm vs loop
def _experts_pair(cfg: ModelConfig, dtype: torch.dtype):
    torch.manual_seed(0)
    gmm = Experts(cfg)
    gmm.reset_parameters(0.2, 0.2)
    loop = Experts(dataclasses.replace(cfg, moe_impl="loop"))
    loop.load_state_dict(gmm.state_dict())
    return gmm.to(dtype), loop.to(dtype)


def _run(experts: Experts, x, chosen, weights, upstream, autocast: bool):
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = experts(x, chosen, weights)
    out.backward(upstream.to(out.dtype))
    return [out.detach(), x.grad, weights.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


def _routing(n: int, k: int, num_experts: int, empty: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randint(0, num_experts + 1, (n, k), generator=g)  # the skip class (num_experts) included
    chosen[chosen == empty] = (empty + 1) % num_experts  # one expert gets no token at all
    weights = torch.rand(n, k, generator=g)
    return chosen, weights


MODES = {  # (parameter dtype, autocast, atol, rtol)
    "fp32": (torch.float32, False, 1e-6, 1e-5),
    "bf16-autocast": (torch.float32, True, 2e-2, 2e-2),
    "bf16-weights": (torch.bfloat16, False, 2e-2, 2e-2),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("top_k", [1, 2])
def test_grouped_mm_matches_loop_reference_with_an_empty_expert(mode, top_k):
    dtype, autocast, atol, rtol = MODES[mode]
    cfg = small_config(num_experts=5, top_k=top_k)
    gmm, loop = _experts_pair(cfg, dtype)
    n, empty = 40, 2
    chosen, weights = _routing(n, top_k, cfg.num_experts, empty, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, cfg.hidden_size, generator=g).to(dtype)
    upstream = torch.randn(n, cfg.hidden_size, generator=g)
    got = _run(gmm, x, chosen, weights.to(dtype), upstream, autocast)
    want = _run(loop, x, chosen, weights.to(dtype), upstream, autocast)
    names = ["out", "x.grad", "weights.grad", "gate_up_proj.grad", "down_proj.grad"]
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype, name
        scale = float(b.abs().max())
        torch.testing.assert_close(a.float(), b.float(), atol=atol * max(scale, 1.0), rtol=rtol, msg=name)
    for grad in got[3:]:
        assert torch.equal(grad[empty], torch.zeros_like(grad[empty]))  # the empty expert: exactly zero
        assert grad[(empty + 1) % cfg.num_experts].abs().sum() > 0
    skipped = (chosen == cfg.num_experts).all(1)
    assert skipped.any()
    assert torch.equal(got[0][skipped], torch.zeros_like(got[0][skipped]))  # skipped tokens: zero output
    assert torch.equal(got[1][skipped], torch.zeros_like(got[1][skipped]))  # ... and zero gradient
    assert torch.equal(got[2][chosen == cfg.num_experts], torch.zeros(int((chosen == cfg.num_experts).sum())))


def test_grouped_mm_k1_is_bitwise_the_loop_reference():
    """top-1, fp32: the same GEMMs over the same rows, so the same bits."""
    cfg = small_config(num_experts=5)
    gmm, loop = _experts_pair(cfg, torch.float32)
    chosen, weights = _routing(40, 1, cfg.num_experts, 2, seed=5)
    g = torch.Generator().manual_seed(6)
    x, upstream = torch.randn(40, cfg.hidden_size, generator=g), torch.randn(40, cfg.hidden_size, generator=g)
    for a, b in zip(_run(gmm, x, chosen, weights, upstream, False), _run(loop, x, chosen, weights, upstream, False)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- poisoned tails
def _poisoned_grouped_mm(real):
    """``F.grouped_mm`` that writes NaN wherever the real op may leave memory uninitialised: output rows past the
    last offset (2-D x 3-D) and the groups with no rows (2-D x 2-D, the weight gradient)."""

    def grouped_mm(a, b, *, offs=None, **kwargs):
        out = real(a, b, offs=offs, **kwargs)
        ends = offs.long()
        if a.dim() == 2 and b.dim() == 3:
            tail = torch.arange(out.shape[0]) >= ends[-1]
            out = out.masked_fill(tail[:, None], float("nan"))
        elif a.dim() == 2 and b.dim() == 2:
            sizes = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
            out = out.masked_fill((sizes == 0)[:, None, None], float("nan"))
        return out

    return grouped_mm


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_uninitialised_grouped_mm_rows_never_leak(monkeypatch, autocast, top_k):
    cfg = small_config(num_experts=5, top_k=top_k)
    gmm, loop = _experts_pair(cfg, torch.float32)
    chosen, weights = _routing(40, top_k, cfg.num_experts, 2, seed=7)
    assert (chosen == cfg.num_experts).float().mean() > 0.1  # a skip fraction: a tail of rows past the offsets
    g = torch.Generator().manual_seed(8)
    x, upstream = torch.randn(40, cfg.hidden_size, generator=g), torch.randn(40, cfg.hidden_size, generator=g)
    want = _run(loop, x, chosen, weights, upstream, autocast)
    monkeypatch.setattr(F, "grouped_mm", _poisoned_grouped_mm(F.grouped_mm))
    got = _run(gmm, x, chosen, weights, upstream, autocast)
    atol = 2e-2 if autocast else 1e-6
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b.float(), atol=atol * max(float(b.abs().max()), 1.0), rtol=atol * 10)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_every_token_skipped_keeps_experts_in_the_graph(impl):
    cfg = small_config(moe_impl=impl)
    experts = Experts(cfg)
    experts.reset_parameters(0.2, 0.2)
    x = torch.randn(6, cfg.hidden_size, requires_grad=True)
    weights = torch.zeros(6, 1, requires_grad=True)
    out = experts(x, torch.full((6, 1), cfg.num_experts), weights)
    assert torch.equal(out, torch.zeros(6, cfg.hidden_size))
    out.sum().backward()
    for p in (experts.gate_up_proj, experts.down_proj):
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))


def test_moe_block_counts_match_bincount_without_padding():
    torch.manual_seed(0)
    cfg = small_config(top_k=2)
    block = MoEBlock(cfg, 0)
    block.reset_parameters(0.1, 2)
    with torch.no_grad():
        block.router.balancing_biases[cfg.num_experts] = 0.0
    h = torch.randn(3, 8, cfg.hidden_size)
    mask = torch.rand(3, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    chosen = block.router(h, None).experts
    for token_mask in (None, mask):
        with HostReads() as reads:
            _, _, counts, _ = block(h, None, token_mask)
        assert reads.total == 0, reads.report()
        kept = chosen.reshape(-1, 2) if token_mask is None else chosen[token_mask]
        assert counts.dtype == torch.int64
        assert torch.equal(counts, torch.bincount(kept.reshape(-1), minlength=block.num_classes))


# ----------------------------------------------------------------------------------------------- DDP, all skipped
DDP_CFG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_query_heads=2, expert_hidden_size=16,
               router_hidden_size=8, max_seq_len=32)


def _ddp_worker(rank: int, world: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = {}
    for impl in ("grouped_mm", "loop"):
        model = tiny_model(**DDP_CFG, moe_impl=impl)
        cfg = model.config
        if rank == 1:
            with torch.no_grad():
                for block in model.blocks:  # this rank routes every token of every layer to the skip class
                    block.moe.router.balancing_biases[cfg.num_experts] = 100.0
        # broadcast_buffers=False: the balancing biases are rank-local buffers, not synced at init either.
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        skipped = []
        for _ in range(2):
            ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
            out = ddp(ids, labels=ids.roll(-1, 1))
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            skipped.append(bool((out.tokens_per_expert[:, : cfg.num_experts] == 0).all()))
        result[impl] = ({n: p.detach().clone() for n, p in model.named_parameters()}, skipped)
    return result


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated")
def test_ddp_with_a_rank_that_skips_every_token():
    """Both impls. Before the static-shape dispatch, the all-skip rank's experts (and its routers' MLPs) got no
    gradient and DDP failed on that rank's second step ("Expected to have finished reduction in the prior
    iteration")."""
    rank0, rank1 = run_ok(_ddp_worker, 2)
    init = dict(tiny_model(**DDP_CFG).named_parameters())
    for impl in ("grouped_mm", "loop"):
        (params0, skipped0), (params1, skipped1) = rank0[impl], rank1[impl]
        assert skipped1 == [True, True] and skipped0 == [False, False], impl
        for name, p in params0.items():
            assert torch.equal(p, params1[name]), (impl, name)
        moved = [n for n in params0 if "experts" in n and not torch.equal(params0[n], init[n].detach())]
        assert moved, impl  # the experts trained (on rank 0's tokens), identically on both ranks


# ----------------------------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("hidden,expert_hidden", [(10, 8), (16, 6)])
def test_unaligned_widths_take_the_loop_under_auto(hidden, expert_hidden):
    """grouped_mm needs 16-byte row strides: "auto" falls back to the loop for other widths, "grouped_mm" says why."""
    cfg = small_config(hidden_size=hidden, expert_hidden_size=expert_hidden, moe_impl="auto")
    experts = Experts(cfg)
    experts.reset_parameters(0.2, 0.2)
    chosen, weights = _routing(12, 1, cfg.num_experts, 2, seed=9)
    x = torch.randn(12, hidden, generator=torch.Generator().manual_seed(10), requires_grad=True)
    out = experts(x, chosen, weights)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    strict = Experts(dataclasses.replace(cfg, moe_impl="grouped_mm"))
    with pytest.raises(RuntimeError, match="multiples of 4"):
        strict(x, chosen, weights)
