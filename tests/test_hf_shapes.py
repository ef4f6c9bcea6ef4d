"""Shapes transformers' ``ZayaConfig`` accepts, odd KV head counts included, against transformers' ZayaForCausalLM.

CCA's value is ``[W_v1 h_t ; W_v2 h_{t-1}]`` viewed as KV heads: the split is over channels, so with an odd number
of KV heads the middle head takes half its channels from each token. These tests pin that split by hand, check that
such configs load, and sweep a covering set of shapes (KV heads 1-4, head_dim 32-128, experts 2-16, the skip class
taken or never taken) for fp32 logits parity in both conversion directions, plus cached decoding.

The models are built, perturbed off their init and routing-calibrated by ``test_hf``'s helpers (see its docstring
for why each step is needed). Tolerance: ``test_hf.TOL`` = 1e-4 absolute on fp32 logits of magnitude ~10; both
sides compute the same fp32 ops, some in a different order, so differences are rounding (measured: at most 2e-6).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("transformers.models.zaya")

from test_hf import TOL, assert_routing_nontrivial, input_batch, make_hf_model, routing_counts  # noqa: E402
from transformers import ZayaForCausalLM as HFZaya  # noqa: E402

import zaya  # noqa: E402
import zaya.model.hf as zhf  # noqa: E402
from zaya.config import ModelConfig, load_config  # noqa: E402
from zaya.model.attention import Attention  # noqa: E402


# ------------------------------------------------------------------------------------------------------ the split
@torch.no_grad()
def test_cca_value_split_is_over_channels_not_heads():
    """Three KV heads of 4 channels: the 6 current-token channels fill head 0 and the first half of head 1, the 6
    previous-token channels the second half of head 1 and head 2 (a split by heads cannot halve three heads)."""
    cfg = ModelConfig(vocab_size=16, hidden_size=2, num_layers=1, num_query_heads=3, num_kv_heads=3, head_dim=4,
                      num_experts=2, expert_hidden_size=4, router_hidden_size=4, max_seq_len=8)
    att = Attention(cfg)
    # The current-token projection reads feature 0 into every channel, the previous-token one feature 1.
    att.v_current_proj.weight.copy_(torch.tensor([[1.0, 0.0]]).expand(6, 2))
    att.v_previous_proj.weight.copy_(torch.tensor([[0.0, 1.0]]).expand(6, 2))
    x = torch.tensor([[[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]])  # token t carries t+1 and 10(t+1)
    _, _, v = att._cca_qkv(x, None)
    for t in range(3):
        previous = 10.0 * t  # token t-1's feature 1 (zero before the start)
        want = torch.tensor([t + 1.0] * 6 + [previous] * 6).view(3, 4)
        assert torch.equal(v[0, t], want), (t, v[0, t])
    assert v[0, 2, 1].tolist() == [3.0, 3.0, 20.0, 20.0]


def test_odd_kv_head_counts_load(tmp_path):
    """The configs transformers builds (one KV head, three) load from zaya TOML and from a HF config.json."""
    path = tmp_path / "c.toml"
    path.write_text("[model]\nnum_query_heads = 6\nnum_kv_heads = 3\n")
    assert load_config(path).model.num_kv_heads == 3
    hf = {"model_type": "zaya", "num_attention_heads": 4, "num_key_value_heads": 1}
    assert zhf.model_config_from_hf(hf).num_kv_heads == 1


# ------------------------------------------------------------------------------------------------------ the sweep
def shape(kv: int, q: int, head_dim: int, experts: int, skip: bool, **extra) -> pytest.param:
    overrides = dict(num_key_value_heads=kv, num_attention_heads=q, head_dim=head_dim, num_experts=experts,
                     hidden_size=32, num_hidden_layers=2, moe_intermediate_size=16, router_hidden_size=8, **extra)
    name = f"kv{kv}-q{q}-d{head_dim}-e{experts}-{'skip' if skip else 'noskip'}"
    return pytest.param(overrides, skip, id=name)


# Every KV head count meets every head_dim; every KV head count meets at least two expert counts and both skip
# settings (transformers' router always has the skip class: "without" means no token takes it); GQA groups of 1,
# 2 and 3; one case with wider CCA kernels and one with untied embeddings.
SHAPES = [
    shape(1, 1, 32, 2, True),
    shape(1, 4, 64, 8, False),
    shape(1, 2, 128, 16, True),
    shape(2, 2, 32, 16, False),
    shape(2, 4, 64, 2, True, tie_word_embeddings=False),
    shape(2, 6, 128, 8, True),
    shape(3, 3, 32, 8, True),
    shape(3, 6, 64, 16, False, cca_time0=3, cca_time1=3),
    shape(3, 3, 128, 2, False),
    shape(4, 4, 32, 2, False),
    shape(4, 8, 64, 8, True),
    shape(4, 4, 128, 16, True),
]


@torch.no_grad()
def never_skip(model: HFZaya) -> None:
    """Skip-class bias -2: its score (probability + bias) is at most -1, below every expert's, whose calibrated bias
    is minus a mean probability (>= -1). ``calibrate_routing``'s -1 can tie or lose with two experts."""
    for layer in model.model.layers:
        layer.mlp.gate.balancing_biases[model.config.num_experts] = -2.0


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("overrides, skip", SHAPES)
@torch.no_grad()
def test_shape_sweep_matches_transformers_both_ways(tmp_path, overrides, skip):
    skip_layers = (1,) if skip else ()
    hf = make_hf_model(skip_layers=skip_layers, **overrides)
    if not skip:
        never_skip(hf)
    hf.save_pretrained(tmp_path / "hf")
    ours = zaya.load_pretrained(tmp_path / "hf")
    ids, mask = input_batch()
    e = overrides["num_experts"]
    assert_routing_nontrivial(routing_counts(ours, ids), e, skip_layers)
    skipped = int(routing_counts(ours, ids)[:, e].sum())
    assert (skipped > 0) == skip, skipped

    # HF -> zaya: unpadded and left-padded (real positions only; see test_hf for why).
    want, want_padded = hf(ids).logits, hf(ids, attention_mask=mask).logits
    assert max_diff(ours(ids).logits, want) < TOL
    assert max_diff(ours(ids, attention_mask=mask).logits[mask.bool()], want_padded[mask.bool()]) < TOL

    # zaya -> HF: the file zaya writes, as transformers loads it (whose from_pretrained re-initialises the
    # balancing biases: they are put back by hand).
    zhf.save_hf(ours, tmp_path / "ours")
    back = HFZaya.from_pretrained(tmp_path / "ours", attn_implementation="sdpa").eval()
    for layer, block in zip(back.model.layers, ours.blocks):
        layer.mlp.gate.balancing_biases.copy_(block.moe.router.balancing_biases)
    assert max_diff(back(ids).logits, want) < TOL

    # Cached decoding (the conv state and the delayed value carry across calls) against transformers' full pass.
    state = ours.new_state(ids.shape[0], ids.shape[1])
    steps = [ours(ids[:, :8], state=state).logits]
    steps += [ours(ids[:, i:i + 1], state=state).logits for i in range(8, ids.shape[1])]
    assert max_diff(torch.cat(steps, 1), want) < TOL
