"""The slot decoder's batched one-token step (``zaya.model.slots``) against the model's forward, for every model
variant: rows at different positions in one step, idle rows left untouched, and the step's packed weights."""

from __future__ import annotations

import pytest
import torch

from model_helpers import MODEL_VARIANTS, perturb, tiny_model
from zaya.model.slots import SlotDecoder


@pytest.mark.parametrize("overrides", MODEL_VARIANTS)
def test_step_with_rows_at_different_positions_equals_the_forward(overrides):
    """Blocks of 3 tokens: prefills and steps cross block boundaries (a chunk of 4 spans two blocks), and a slot's
    blocks are not contiguous in the pool (the slots take them in turn)."""
    model = tiny_model(**overrides).eval()
    perturb(model, seed=7)
    lengths = [3, 11, 6, 8]  # prompt length per slot; slot 2 stays idle during the steps below
    seqs = [torch.randint(0, 97, (n + 4,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
    decoder = SlotDecoder(model, num_slots=4, capacity=24, block_size=3)
    with torch.no_grad():
        for slot, (n, seq) in enumerate(zip(lengths, seqs)):
            decoder.reset(slot)
            decoder.ensure(slot, 2)
        for slot, (n, seq) in enumerate(zip(lengths, seqs)):
            decoder.prefill(slot, seq[:n], 0, chunk=4)
            decoder.ensure(slot, n + 4)
        idle = torch.tensor([False, False, True, False])
        idle_state = [(c.conv_state[2].clone(), c.value_state[2].clone()) if c.conv_state is not None else None
                      for c in decoder.caches]
        positions = torch.tensor(lengths)
        got = []
        for i in range(4):
            tokens = torch.stack([seq[n + i] for n, seq in zip(lengths, seqs)])
            got.append(decoder.step(tokens, positions + i, keys=int((positions + i).max()) + 1, idle=idle))
        for slot, (n, seq) in enumerate(zip(lengths, seqs)):
            if slot == 2:
                continue
            full = model(seq[None]).logits[0]
            for i in range(4):
                # fp32; the step folds the two convolutions into one matmul and packs the projections: a
                # different rounding order from the forward's (measured: at most 2e-7 on logits up to ~0.5)
                assert (got[i][slot] - full[n + i]).abs().max() < 1e-5, (slot, i)
        for cache, before in zip(decoder.caches, idle_state):
            if before is not None:  # the idle row's CCA state did not move
                assert torch.equal(cache.conv_state[2], before[0]) and torch.equal(cache.value_state[2], before[1])
        # the idle slot then continues from its prompt as if the other rows' steps had not happened
        n, seq = lengths[2], seqs[2]
        logits = decoder.step(torch.stack([seqs[0][0], seqs[1][0], seq[n]]), torch.tensor([0, 0, n]), keys=n + 1,
                              idle=torch.tensor([True, True, False]))
        assert (logits[2] - model(seq[None, :n + 1]).logits[0, n]).abs().max() < 1e-5


def test_a_prefill_after_decode_steps_sees_the_keys_they_wrote():
    """Decode steps mark the keys they write valid, so a multi-token forward after them (speculative decoding's
    check) attends to those positions: its logits equal the full forward's."""
    model = tiny_model().eval()
    perturb(model, seed=9)
    seq = torch.randint(0, 97, (14,), generator=torch.Generator().manual_seed(5))
    decoder = SlotDecoder(model, num_slots=2, capacity=16, block_size=4)
    with torch.no_grad():
        decoder.reset(0, 2)
        decoder.prefill(0, seq[:6], 0)
        decoder.ensure(0, 9)
        for p in range(6, 9):
            decoder.step(seq[p:p + 1], torch.tensor([p]), keys=p + 1)
        logits = decoder.prefill(0, seq[9:14], 9, all_logits=True)[0]
        full = model(seq[None]).logits[0]
    assert (logits - full[9:14]).abs().max() < 1e-5  # fp32, a different rounding order (as above)


@pytest.mark.parametrize("overrides", MODEL_VARIANTS[:2])
def test_aligned_step_without_a_mask_equals_the_forward(overrides):
    """``aligned``: every row at the same position (a fixed batch without padding), so the step drops the mask."""
    model = tiny_model(**overrides).eval()
    perturb(model, seed=8)
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(3))
    decoder = SlotDecoder(model, num_slots=3, capacity=16)
    with torch.no_grad():
        decoder.prefill(0, ids[:, :9], 0)
        full = model(ids).logits
        for p in range(9, 12):
            logits = decoder.step(ids[:, p], torch.full((3,), p), keys=p + 1, aligned=True)
            assert (logits - full[:, p]).abs().max() < 1e-5, p


def test_single_query_attention_equals_sdpa():
    """The step's attention (two matmuls) against SDPA with GQA, with per-row masks of different lengths."""
    import torch.nn.functional as F

    from zaya.model.slots import _single_query_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((3, 4, 16), (3, 2, 9, 16), (3, 2, 9, 16)))
    allowed = torch.arange(9)[None, :] <= torch.tensor([8, 2, 0])[:, None]
    bias = torch.zeros(3, 9).masked_fill_(~allowed, float("-inf"))[:, None, None]
    for b, m in ((bias, allowed[:, None, None]), (None, None)):
        want = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=m, enable_gqa=True).reshape(3, 64)
        torch.testing.assert_close(_single_query_attention(q, k, v, b), want, rtol=0, atol=1e-6)  # fp32 rounding
    # bf16 (the softmax runs in fp32): within SDPA's own bf16 error of the fp32 result, plus one bf16 rounding
    # (2^-8 relative) of outputs under ~2 in size
    want = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=allowed[:, None, None], enable_gqa=True)
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    sdpa16 = F.scaled_dot_product_attention(q16[:, :, None], k16, v16, attn_mask=allowed[:, None, None],
                                            enable_gqa=True).float().reshape(3, 64)
    ours16 = _single_query_attention(q16, k16, v16, bias)
    assert ours16.dtype == torch.bfloat16
    ours16 = ours16.float()
    sdpa_err = (sdpa16 - want.reshape(3, 64)).abs().max()
    assert (ours16 - want.reshape(3, 64)).abs().max() <= sdpa_err + 2 * 2**-8



def test_the_compiled_step_equals_the_eager_one_without_recompiling(monkeypatch):
    """``compile``: one graph (dynamic shapes) serves a growing attention span, block boundaries and rows at
    different positions; its logits equal the eager step's. Traced by dynamo into a counting backend that runs the
    graph as it is (inductor's code generation takes minutes here; benchmarks/serve.py --compile measures it)."""
    from torch._dynamo.testing import CompileCounter

    import zaya.model.slots as slots

    counter = CompileCounter()
    monkeypatch.setattr(slots, "COMPILE_BACKEND", counter)
    torch._dynamo.reset()
    model = tiny_model(num_layers=1).eval()  # one CCA block: tracing time grows with the layers, not what is checked
    perturb(model, seed=3)
    seq = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    decoders = [SlotDecoder(model, 2, 32, block_size=4, compile=c) for c in (False, True)]
    with torch.no_grad():
        for dec in decoders:
            dec.prefill(0, seq[0, :5], 0)
            dec.prefill(1, seq[1, :9], 0)
            dec.ensure(0, 30)
            dec.ensure(1, 30)
        for i in range(12):
            positions = torch.tensor([5 + i, 9 + i])
            tokens = seq[torch.arange(2), positions]
            eager, compiled = (dec.step(tokens, positions, keys=10 + i) for dec in decoders)
            torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)  # the same ops; fp32 rounding at most
    assert counter.frame_count == 1 and counter.op_count > 0
    torch._dynamo.reset()


def test_a_step_padded_to_its_cuda_graph_bucket_equals_the_step():
    """What a CUDA graph of the compiled step relies on (``zaya.model.decode_graphs``; the graphs themselves need a
    GPU: benchmarks/gpu_decode.py): the rows padded with idle ones and the span padded with masked keys give the
    same logits and leave the same KV blocks and CCA state as the step itself; and the bucket choice."""
    from zaya.model.decode_graphs import DecodeGraphs, bucket, graphs_wanted

    assert [bucket(n, 1, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert [bucket(k, 64, 100) for k in (1, 64, 65, 99)] == [64, 64, 100, 100]
    assert graphs_wanted(torch.device("cuda", 0)) and not graphs_wanted(torch.device("cpu"))
    model = tiny_model(num_layers=1).eval()
    perturb(model, seed=11)
    lengths = [7, 3, 12]
    seqs = [torch.randint(0, 97, (n + 6,), generator=torch.Generator().manual_seed(20 + i))
            for i, n in enumerate(lengths)]
    decoders = [SlotDecoder(model, 8, 100, block_size=4, prefix_states=True) for _ in range(2)]
    assert decoders[0]._graphs is None  # not compiled; compiled on a CPU: no graphs either (below)
    padding = DecodeGraphs(decoders[1]._step, 8, 100, torch.device("cpu"))
    idle = torch.tensor([False, True, False])  # the middle row sits out the first three steps
    with torch.no_grad():
        for dec in decoders:
            for slot, (n, seq) in enumerate(zip(lengths, seqs)):
                dec.prefill(slot, seq[:n], 0)
                dec.ensure(slot, n + 6)
        positions = torch.tensor(lengths)
        for i in range(6):
            tokens = torch.stack([seq[p] for seq, p in zip(seqs, positions.tolist())])
            step_idle = idle if i < 3 else None
            keys = int(positions.max()) + 1
            want = decoders[0].step(tokens, positions, keys, step_idle)
            rows, span = padding.pad(tokens, positions, keys, step_idle)
            assert (rows, span) == (4, 64)
            got = decoders[1]._step(padding.tokens[:rows], padding.positions[:rows], span, padding.idle[:rows],
                                    False)[:3]
            # fp32; the padded keys add exact zeros to the softmax, but a longer row may be summed in another order
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            positions = positions + (~idle if i < 3 else 1)
    # the same blocks hold the same keys, values and (for full blocks) CCA states; the rows' CCA states are equal
    final = positions.tolist()
    assert decoders[0].slot_blocks == decoders[1].slot_blocks
    held = torch.tensor([b for blocks in decoders[0].slot_blocks for b in blocks])
    full = torch.tensor([b for blocks, n in zip(decoders[0].slot_blocks, final) for b in blocks[:n // 4]])
    pool_rows = (held[:, None] * 4 + torch.arange(4)).reshape(-1)
    for a, b in zip(decoders[0].pages, decoders[1].pages):
        for x, y, index in ((a.keys, b.keys, pool_rows), (a.values, b.values, pool_rows), (a.conv, b.conv, full),
                            (a.value, b.value, full)):
            if x is not None:
                torch.testing.assert_close(y[index], x[index], rtol=0, atol=1e-6)
    for a, b in zip(decoders[0].caches, decoders[1].caches):
        for x, y in ((a.conv_state, b.conv_state), (a.value_state, b.value_state)):
            if x is not None:
                torch.testing.assert_close(y[:3], x[:3], rtol=0, atol=1e-6)
    compiled = SlotDecoder(model, 2, 16, compile=True)
    assert compiled._compiled is not None and compiled._graphs is None
