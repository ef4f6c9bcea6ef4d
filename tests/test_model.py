"""Model components against straightforward references, gradient flow, decoding, generation, presets.

Tolerances: everything runs in fp32 (fp64 for the references where noted); 1e-5 absolute covers fp32 rounding of
the reordered sums at these sizes (values are O(1)), and is the bar the issue sets for decode-equals-forward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model_helpers import MODEL_VARIANTS, perturb, tiny_config, tiny_model
from zaya.config import ModelConfig
from zaya.model import ZayaForCausalLM, update_balancing_biases
from zaya.model.attention import Attention
from zaya.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from zaya.model.moe import Experts, MoEBlock, grouped_mm_supported
from zaya.model.router import LinearRouter, ZayaRouter
from zaya.serve.generate import generate


# ----------------------------------------------------------------------------------------------- layers
def test_rmsnorm_matches_reference():
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5)
    norm.weight.data = torch.randn(32)
    x = torch.randn(3, 5, 32)
    ref = x / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-5).float() * norm.weight
    torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=1e-5)


def test_partial_rope_rotates_pairs_of_the_leading_channels():
    torch.manual_seed(0)
    head_dim, rot, theta = 16, 8, 100.0
    rope = RotaryEmbedding(rot, theta)
    x = torch.randn(2, 3, 7, head_dim)
    cos, sin = rope.cos_sin(torch.arange(7))
    out = apply_rotary(x, cos, sin)
    ref = x.clone()
    half = rot // 2
    for t in range(7):
        for i in range(half):
            angle = t / theta ** (2 * i / rot)
            a, b = x[..., t, i], x[..., t, i + half]
            ref[..., t, i] = a * math.cos(angle) - b * math.sin(angle)
            ref[..., t, i + half] = b * math.cos(angle) + a * math.sin(angle)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[..., rot:], x[..., rot:])


# ----------------------------------------------------------------------------------------------- attention
def reference_cca(att: Attention, x: torch.Tensor, cfg: ModelConfig, mask: torch.Tensor | None) -> torch.Tensor:
    """CCA written token by token from the paper's description, in fp64."""
    x = x.double()
    if mask is not None:
        x = x * mask[..., None].double()
    b, t, _ = x.shape
    hq, hk, hd = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    g = hq // hk
    w = {n: p.detach().double() for n, p in att.named_parameters()}
    q = x @ w["q_proj.weight"].T  # [B, T, hq*hd]
    k = x @ w["k_proj.weight"].T
    packed = torch.cat([q, k], -1)  # [B, T, C]
    c = packed.shape[-1]
    k0, k1 = cfg.cca_depthwise_kernel, cfg.cca_grouped_kernel
    # depthwise conv: output at step s uses inputs s-k0+1..s (zeros before 0); computed for s >= -(k1-1)
    def packed_at(s):
        return packed[:, s] if s >= 0 else torch.zeros(b, c, dtype=x.dtype)
    def depthwise_at(s):
        acc = w["conv_depthwise.bias"].expand(b, c).clone()
        for j in range(k0):
            acc = acc + w["conv_depthwise.weight"][:, 0, j] * packed_at(s - (k0 - 1) + j)
        return acc
    groups = hq + hk
    per = c // groups
    conv = torch.zeros(b, t, c, dtype=x.dtype)
    for s in range(t):
        for gi in range(groups):
            sl = slice(gi * per, (gi + 1) * per)
            acc = w["conv_grouped.bias"][sl].expand(b, per).clone()
            for j in range(k1):
                inp = depthwise_at(s - (k1 - 1) + j)[:, sl]  # [B, per]
                acc = acc + inp @ w["conv_grouped.weight"][sl, :, j].T
            conv[:, s, sl] = acc
    qh = q.view(b, t, hq, hd)
    kh = k.view(b, t, hk, hd)
    q_mean = torch.stack([(qh[:, :, i] + kh[:, :, i // g]) / 2 for i in range(hq)], 2)
    k_mean = torch.stack([q_mean[:, :, j * g:(j + 1) * g].mean(2) for j in range(hk)], 2)
    qf = conv[..., : hq * hd].view(b, t, hq, hd) + q_mean
    kf = conv[..., hq * hd:].view(b, t, hk, hd) + k_mean
    v_cur = x @ w["v_current_proj.weight"].T
    v_del = x @ w["v_previous_proj.weight"].T
    v_prev = torch.cat([torch.zeros_like(v_del[:, :1]), v_del[:, :-1]], 1)
    v = torch.cat([v_cur, v_prev], -1).view(b, t, hk, hd)
    qf = qf / qf.norm(dim=-1, keepdim=True) * math.sqrt(hd)
    kf = kf / kf.norm(dim=-1, keepdim=True) * math.sqrt(hd) * w["temperature"][:, None]
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
    cos, sin = rope.cos_sin(torch.arange(t))
    qf = apply_rotary(qf.transpose(1, 2), cos.double(), sin.double())
    kf = apply_rotary(kf.transpose(1, 2), cos.double(), sin.double())
    v = v.transpose(1, 2)
    out = torch.zeros(b, hq, t, hd, dtype=x.dtype)
    for i in range(hq):
        scores = qf[:, i] @ kf[:, i // g].transpose(-1, -2) / math.sqrt(hd)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t).clone()
        if mask is not None:
            allowed &= mask[:, None, :].bool()
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, i] = torch.nan_to_num(scores.softmax(-1)) @ v[:, i // g]
    return out.transpose(1, 2).reshape(b, t, hq * hd) @ w["o_proj.weight"].T


@pytest.mark.parametrize("kernels", [(2, 2), (3, 2)])
def test_cca_matches_token_by_token_reference(kernels):
    torch.manual_seed(0)
    cfg = tiny_config(cca_depthwise_kernel=kernels[0], cca_grouped_kernel=kernels[1], rope_theta=500.0)
    att = Attention(cfg)
    att.reset_parameters(0.1, 0.1)
    perturb(att)
    x = torch.randn(2, 9, cfg.hidden_size)
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
    cos, sin = rope.cos_sin(torch.arange(9))
    out = att(x, cos, sin)
    torch.testing.assert_close(out.double(), reference_cca(att, x, cfg, None), atol=1e-5, rtol=1e-4)


def test_cca_left_padding_zeroes_pad_tokens_and_masks_them():
    torch.manual_seed(1)
    cfg = tiny_config()
    att = Attention(cfg)
    att.reset_parameters(0.1, 0.1)
    perturb(att)
    x = torch.randn(2, 8, cfg.hidden_size)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :3] = False
    cos, sin = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta).cos_sin(torch.arange(8))
    model_mask = ZayaForCausalLM._attention_mask(mask, None, 0, 8, x.device)
    out = att(x, cos, sin, token_mask=mask, attn_mask=model_mask)
    ref = reference_cca(att, x, cfg, mask)
    torch.testing.assert_close(out.double()[mask], ref[mask], atol=1e-5, rtol=1e-4)
    # Whatever the padding holds must not matter.
    x2 = x.clone()
    x2[0, :3] = torch.randn(3, cfg.hidden_size) * 10
    out2 = att(x2, cos, sin, token_mask=mask, attn_mask=model_mask)
    torch.testing.assert_close(out2[mask], out[mask], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind,kv", [("gqa", 2), ("mha", 4)])
def test_plain_attention_baselines_match_reference(kind, kv):
    torch.manual_seed(0)
    cfg = tiny_config(attention=kind, num_kv_heads=kv)
    att = Attention(cfg)
    att.reset_parameters(0.1, 0.1)
    x = torch.randn(2, 7, cfg.hidden_size)
    cos, sin = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta).cos_sin(torch.arange(7))
    out = att(x, cos, sin)
    b, t, hq, hd = 2, 7, cfg.num_query_heads, cfg.head_dim
    q = (x @ att.q_proj.weight.T).view(b, t, hq, hd).transpose(1, 2)
    k = (x @ att.k_proj.weight.T).view(b, t, kv, hd).transpose(1, 2)
    v = (x @ att.v_proj.weight.T).view(b, t, kv, hd).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rep = hq // kv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(),
                                                                   float("-inf"))
    ref = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1) @ att.o_proj.weight.T
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert not hasattr(att, "conv_depthwise")


# ----------------------------------------------------------------------------------------------- router
def test_zaya_router_matches_reference_and_biases_only_steer_the_choice():
    torch.manual_seed(0)
    cfg = tiny_config(num_experts=6)
    router = ZayaRouter(cfg, use_eda=True)
    router.reset_parameters()
    perturb(router)
    router.balancing_biases.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1, 0.0, 0.05, 0.2]))
    h = torch.randn(2, 5, cfg.hidden_size)
    prev = torch.randn(2, 5, cfg.router_hidden_size)
    routing = router(h, prev)
    r = h @ router.down_proj.weight.T + router.down_proj.bias + prev * router.eda_scale
    z = r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * router.norm.weight
    z = F.gelu(z @ router.fc1.weight.T + router.fc1.bias)
    z = F.gelu(z @ router.fc2.weight.T + router.fc2.bias)
    p = (z @ router.out_proj.weight.T).softmax(-1)
    choice = (p + router.balancing_biases).argmax(-1, keepdim=True)
    weight = p.gather(-1, choice).masked_fill(choice == cfg.num_experts, 0.0)
    assert torch.equal(routing.experts, choice)
    torch.testing.assert_close(routing.weights, weight, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(routing.latent, r, atol=1e-6, rtol=1e-5)
    # Biases change the choice, not the mixing weights' values for a given choice.
    assert not torch.equal(choice, p.argmax(-1, keepdim=True))


def test_zaya_router_skip_class_and_first_layer_has_no_eda():
    cfg = tiny_config()
    first = ZayaRouter(cfg, use_eda=False)
    assert not hasattr(first, "eda_scale")
    assert first.num_classes == cfg.num_experts + 1
    assert first.balancing_biases[-1] == cfg.router_skip_bias_init
    first.balancing_biases[-1] = 10.0  # force everything to skip
    routing = first(torch.randn(1, 4, cfg.hidden_size), None)
    assert (routing.experts == cfg.num_experts).all() and (routing.weights == 0).all()
    assert ModelConfig(router_skip_expert=False).num_router_classes == 16


def test_linear_router_top2():
    torch.manual_seed(0)
    cfg = tiny_config(router="linear", top_k=2)
    router = LinearRouter(cfg)
    router.reset_parameters()
    h = torch.randn(3, cfg.hidden_size)
    routing = router(h, None)
    p = (h @ router.proj.weight.T).softmax(-1)
    top = p.topk(2, -1)
    assert torch.equal(routing.experts, top.indices)
    torch.testing.assert_close(routing.weights, top.values)
    assert routing.latent is None


# ----------------------------------------------------------------------------------------------- experts
def reference_experts(experts: Experts, x, chosen, weights):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for slot in range(chosen.shape[1]):
            e = int(chosen[n, slot])
            if e >= experts.num_experts:
                continue
            gate_up = experts.gate_up_proj[e] @ x[n]
            gate, up = gate_up.chunk(2)
            out[n] += weights[n, slot] * (experts.down_proj[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_expert_dispatch_matches_per_token_reference(impl, top_k):
    if impl == "grouped_mm" and not grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip("grouped_mm unavailable")
    torch.manual_seed(0)
    cfg = tiny_config(moe_impl=impl, top_k=top_k, num_experts=5)
    experts = Experts(cfg)
    experts.reset_parameters(0.2, 0.2)
    x = torch.randn(11, cfg.hidden_size, requires_grad=True)
    chosen = torch.randint(0, cfg.num_experts + 1, (11, top_k))  # includes the skip class
    chosen[:, 0][chosen[:, 0] == 2] = 3  # leave expert 2 empty for slot 0
    weights = torch.rand(11, top_k, requires_grad=True)
    out = experts(x, chosen, weights)
    ref = reference_experts(experts, x, chosen, weights)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x, weights, experts.gate_up_proj, experts.down_proj])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, weights, experts.gate_up_proj, experts.down_proj])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_experts_with_every_token_skipped_return_zero():
    cfg = tiny_config()
    experts = Experts(cfg)
    experts.reset_parameters(0.2, 0.2)
    out = experts(torch.randn(4, cfg.hidden_size), torch.full((4, 1), cfg.num_experts), torch.zeros(4, 1))
    assert torch.equal(out, torch.zeros(4, cfg.hidden_size))


def test_moe_block_counts_exclude_padding():
    torch.manual_seed(0)
    cfg = tiny_config(top_k=2, router="linear")
    block = MoEBlock(cfg, 0)
    block.reset_parameters(0.1, 3)
    mask = torch.tensor([[False, True, True, True], [True, True, True, True]])
    _, _, counts, _ = block(torch.randn(2, 4, cfg.hidden_size), None, mask)
    assert counts.sum() == 7 * 2


# ----------------------------------------------------------------------------------------------- balancing
def test_balancing_update_is_an_adam_step_on_load_error():
    cfg = tiny_config(num_layers=2, num_experts=4, router_balance_lr=0.01, router_balancing="adamw")
    model = ZayaForCausalLM(cfg)
    counts = torch.tensor([[10, 2, 2, 2, 5], [4, 4, 4, 4, 0]])
    before = [b.moe.router.balancing_biases.clone() for b in model.blocks]
    imbalance = update_balancing_biases(model, counts)
    f = counts[0, :4].double() / 16
    g = (f - 0.25).float()
    m_hat, v_hat = g, g * g  # first step: bias correction undoes (1 - beta)
    expected = before[0][:4] - 0.01 * m_hat / (v_hat.sqrt() + cfg.router_balance_eps)
    torch.testing.assert_close(model.blocks[0].moe.router.balancing_biases[:4], expected)
    assert model.blocks[0].moe.router.balancing_biases[0] < 0  # the overloaded expert is pushed down
    assert model.blocks[0].moe.router.balancing_biases[4] == before[0][4]  # skip bias untouched
    torch.testing.assert_close(model.blocks[1].moe.router.balancing_biases, before[1])  # balanced: g = 0
    assert imbalance[0] == pytest.approx(10 / 16 * 4)


@pytest.mark.parametrize("rule", ["adaptive", "adamw"])
def test_balancing_reduces_imbalance_over_steps(rule):
    torch.manual_seed(0)
    cfg = tiny_config(num_layers=1, num_experts=4, router="linear", router_balance_lr=0.02, router_balancing=rule)
    model = ZayaForCausalLM(cfg)
    with torch.no_grad():
        model.blocks[0].moe.router.proj.weight[0] += 0.5  # a router that prefers expert 0
    ids = torch.randint(0, cfg.vocab_size, (8, 32))
    first = None
    for _ in range(60):
        out = model(ids)
        imbalance = float(update_balancing_biases(model, out.tokens_per_expert)[0])
        first = first or imbalance
    assert first > 1.5 and imbalance < 1.3


# ----------------------------------------------------------------------------------------------- whole model
@pytest.mark.parametrize("overrides", MODEL_VARIANTS)
def test_gradient_reaches_every_parameter(overrides):
    model = tiny_model(**overrides)
    perturb(model)
    for b in model.blocks:
        b.moe.router.reset_balancing()  # skip class at -1: experts get the tokens
    ids = torch.randint(0, 97, (4, 24))
    out = model(ids, labels=ids.roll(-1, 1))
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or p.grad.abs().sum() == 0]
    assert not missing


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_raw_gradients_have_their_parameters_strides(backend):
    """The gradients autograd hands to each parameter (before AccumulateGrad re-lays them out) keep the parameter's
    strides, eager and with the blocks compiled (as ``train.compile`` does; "aot_eager" traces the same graphs as
    inductor). DDP's reducer and FSDP take those raw gradients: one laid out otherwise (the CCA convolutions run
    channels-last) makes DDP warn "Grad strides do not match bucket view strides" and copy it on every step."""
    model = tiny_model(cca_grouped_kernel=3, num_layers=2 if backend else 3)
    perturb(model)
    if backend:
        torch._dynamo.reset()
        for block in model.blocks:
            block.compile(backend=backend, dynamic=False)
    ids = torch.randint(0, 97, (2, 20))
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(model(ids, labels=ids.roll(-1, 1)).loss, params, allow_unused=True)
    wrong = [(n, tuple(g.stride()), tuple(p.stride())) for n, p, g in zip(names, params, grads)
             if g is not None and g.stride() != p.stride()]
    assert not wrong


@pytest.mark.parametrize("overrides", MODEL_VARIANTS)
def test_decode_equals_full_forward(overrides):
    model = tiny_model(**overrides).eval()
    perturb(model, seed=3)
    ids = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        full = model(ids).logits
        state = model.new_state(3, 20)
        parts = [model(ids[:, :6], state=state).logits, model(ids[:, 6:9], state=state).logits]
        parts += [model(ids[:, i:i + 1], state=state).logits for i in range(9, 20)]
    assert state.length == 20
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-5


def test_decode_equals_forward_with_left_padding():
    model = tiny_model().eval()
    perturb(model, seed=4)
    ids = torch.randint(1, 97, (3, 14))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        state = model.new_state(3, 14)
        parts = [model(ids[:, :7], attention_mask=mask[:, :7], state=state).logits]
        parts += [model(ids[:, i:i + 1], state=state).logits for i in range(7, 14)]
    dec = torch.cat(parts, 1)
    valid = mask.bool()
    assert (dec[valid] - full[valid]).abs().max() < 1e-5
    # A left-padded row gives the same logits as the same tokens unpadded (RoPE is relative).
    alone = model(ids[:1, 4:]).logits
    assert (alone[0] - full[0, 4:]).abs().max() < 1e-4


def test_generate_is_reproducible_and_greedy_matches_argmax():
    model = tiny_model().eval()
    perturb(model, seed=5)
    prompt = torch.randint(0, 97, (2, 5))
    a = generate(model, prompt, 6, temperature=0.9, top_k=10, top_p=0.9, seed=7)
    b = generate(model, prompt, 6, temperature=0.9, top_k=10, top_p=0.9, seed=7)
    assert a.shape == (2, 11) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)
    greedy = generate(model, prompt, 4, temperature=0)
    seq = prompt
    for _ in range(4):
        nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(greedy, seq)


def _generate_checking_every_token(model, prompt, max_new_tokens, eos, **kw):
    """generate() as it was: the same decode loop, asking after every token whether every row emitted eos."""
    from zaya.serve.sampling import sample_next

    b, t = prompt.shape
    state = model.new_state(b, t + max_new_tokens)
    gen = torch.Generator().manual_seed(kw["seed"]) if "seed" in kw else None
    with torch.no_grad():
        logits = model(prompt, state=state, logits_to_keep=1).logits[:, -1]
        done = torch.zeros(b, dtype=torch.bool)
        tokens = []
        for step in range(max_new_tokens):
            token = sample_next(logits, kw.get("temperature", 1.0), kw.get("top_k"), None, gen)
            token = torch.where(done, torch.full_like(token, eos), token)
            done |= token == eos
            tokens.append(token)
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            logits = model(token[:, None], state=state).logits[:, -1]
    out = torch.cat([prompt, torch.stack(tokens, 1)], 1)
    return torch.cat([out, torch.full((b, t + max_new_tokens - out.shape[1]), eos)], 1)


def test_generate_eos_stop_checked_every_16_tokens_gives_the_same_output():
    from zaya.distributed.checks import HostReads
    from zaya.serve.sampling import EOS_CHECK_EVERY

    model = tiny_model(num_layers=2).eval()
    perturb(model, seed=5)
    prompt = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(2))
    n = EOS_CHECK_EVERY + 4
    sampled = dict(temperature=1.0, top_k=8, seed=3)
    free = generate(model, prompt, n, **sampled)[:, 4:]
    greedy = generate(model, prompt, n, temperature=0)[:, 4:]
    # eos = a token both rows sample early (all rows finish before the first check: the early stop is exercised),
    # the first greedy token of row 0 only (one row finishes), or a token no row emits.
    both = set(free[0, :8].tolist()) & set(free[1, :8].tolist())
    assert both
    never = next(tok for tok in range(97) if not (greedy == tok).any())
    cases = [(min(both), sampled), (int(greedy[0, 0]), dict(temperature=0)), (never, dict(temperature=0))]
    for i, (eos, kw) in enumerate(cases):
        want = _generate_checking_every_token(model, prompt, n, eos, **kw)
        if i == 0:  # one read for the prompt's ids, then one per EOS_CHECK_EVERY decoded tokens (here: it stops)
            with HostReads() as reads:
                got = generate(model, prompt, n, eos_token_id=eos, **kw)
            assert reads.total == 1 + n // EOS_CHECK_EVERY, reads.report()
            assert (want[:, 4 + EOS_CHECK_EVERY:] == eos).all()
        else:
            got = generate(model, prompt, n, eos_token_id=eos, **kw)
        assert torch.equal(got, want), (eos, kw)
    assert (want[:, 4:] == never).sum() == 0


def test_sampling_respects_top_k_and_top_p():
    from zaya.serve.sampling import sample_next

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, 2, None, g).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, None, 0.7, g).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, None, 0.5, g).tolist()) == {0}


def test_residual_stream_is_fp32_with_bf16_weights():
    model = tiny_model().to(torch.bfloat16)
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    out = model(torch.randint(0, 97, (1, 6)))
    assert seen == [torch.float32] and out.logits.dtype == torch.bfloat16


def test_forward_rejects_bad_inputs():
    model = tiny_model()
    with pytest.raises(ValueError, match="id 200, outside \\[0, vocab_size=97\\)"):
        model.check_input_ids(torch.tensor([[1, 200]]))
    with pytest.raises(ValueError, match="id -3, outside"):
        model.check_input_ids(torch.tensor([[-3, 2]]))
    model.check_input_ids(torch.tensor([[0, 96]]))
    with pytest.raises(ValueError, match="vocab_size=97"):  # generate checks its prompt
        generate(model, torch.tensor([[1, 97]]), 2)
    with pytest.raises(ValueError, match="attention_mask shape"):
        model(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3))
    state = model.new_state(1, 4)
    with pytest.raises(ValueError, match="decode state holds 4"):
        model(torch.ones(1, 5, dtype=torch.long), state=state)


def test_base_preset_parameter_count_on_meta_device():
    from zaya.config import load_config
    from zaya.model.info import model_info

    info = model_info(load_config("configs/zaya1-base.toml").model)
    assert info["params_total"] == 8_840_488_784
    assert info["params_embedding"] == 537_133_056
    assert info["params_active"] == 8_840_488_784 - 40 * 15 * 3 * 2048 * 2048
    assert round(info["params_active_non_embedding"] / 1e9, 4) == 0.7536
    assert info["kv_cache_bytes_per_token"] == 40 * 2 * 2 * 128 * 2


def test_info_flops_match_a_measured_count():
    """flops_per_token's matmul parts against FLOPs counted by torch's FlopCounterMode on a real forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from zaya.model.info import forward_flops_per_token

    cfg = tiny_config(moe_impl="loop", router_skip_expert=False)
    model = ZayaForCausalLM(cfg)
    t = 16
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 97, (1, t)))
    measured = counter.get_total_flops()
    parts = forward_flops_per_token(cfg, context=t)
    # FlopCounterMode does not see inside CPU SDPA, so compare everything but the attention scores. The depthwise
    # conv also runs over the reach positions before the sequence, hence a tolerance of 0.5%.
    expected = (sum(parts.values()) - parts["attention_scores"]) * t
    assert measured == pytest.approx(expected, rel=0.005)
    assert parts["attention_scores"] == cfg.num_layers * 2 * 2 * cfg.num_query_heads * cfg.head_dim * t
