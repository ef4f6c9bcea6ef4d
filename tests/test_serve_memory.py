"""The slots' KV cache and CCA state are checked against the memory available before anything is allocated: a
``max_seq_len`` of 2**40 in a checkpoint's config made ``zaya serve`` fail in ``torch.zeros`` (exit 70), and a value
just small enough would have taken every free byte. ``zaya serve --max-model-len`` sets the context each slot holds
(default the model's max_seq_len, at most 8192); the refusals name the bytes and the flags that fix them."""

from __future__ import annotations

import pytest
import torch

from serve_helpers import served_checkpoint, served_model
from zaya.serve.generate import generate

HUGE = 2**40
LONG = 10**9
"""A config's max_seq_len that zaya's config check lets through (it stops at 2**31), still 8 TB of slots here."""


@pytest.fixture(scope="module")
def huge_context(shakespeare_dataset, tmp_path_factory):
    """A checkpoint whose config says max_seq_len = 10**9 (nothing in the model is sized by it)."""
    return served_checkpoint(tmp_path_factory.mktemp("huge") / "ckpt", shakespeare_dataset / "tokenizer.json",
                             max_seq_len=LONG)


def test_bytes_needed_is_what_a_decoder_allocates():
    from zaya.model.slots import SlotDecoder

    model = served_model(vocab_size=512, max_seq_len=64)
    for dtype, blocks, states in ((None, None, False), (torch.bfloat16, 7, True)):
        decoder = SlotDecoder(model, 3, 50, dtype, block_size=8, num_blocks=blocks, prefix_states=states)
        held = decoder.key_valid.nbytes + decoder._key_index.nbytes + decoder.table.nbytes + sum(
            t.nbytes for c in decoder.caches for t in (c.conv_state, c.value_state) if t is not None) + sum(
            t.nbytes for p in decoder.pages for t in (p.keys, p.values, p.conv, p.value) if t is not None)
        assert SlotDecoder.bytes_needed(model, 3, 50, dtype, 8, blocks, states) == held


def test_slots_that_do_not_fit_are_refused_before_anything_is_allocated(monkeypatch):
    import zaya.model.slots as slots
    from zaya.core.errors import ConfigError

    model = served_model(vocab_size=512, max_seq_len=HUGE)
    with pytest.raises(slots.SlotMemoryError, match=r"16 slot\(s\) of 1,099,511,627,776 tokens need") as caught:
        slots.SlotDecoder(model, 16, HUGE)
    assert isinstance(caught.value, ConfigError) and caught.value.needed > 2**50
    with pytest.raises(slots.SlotMemoryError):  # generate sizes its cache by prompt + max_new_tokens
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=HUGE)

    # just too much for what is free: refused, and the model's state is never asked for
    needed = slots.SlotDecoder.bytes_needed(model, 4, 1000)
    monkeypatch.setattr(slots, "available_memory", lambda device: needed - 1)
    monkeypatch.setattr(type(model), "new_state", lambda *a, **k: pytest.fail("allocated before the check"))
    with pytest.raises(slots.SlotMemoryError, match=f"need {needed:,} bytes .* has {needed - 1:,} bytes"):
        slots.SlotDecoder(model, 4, 1000)
    monkeypatch.undo()
    monkeypatch.setattr(slots, "available_memory", lambda device: needed)
    assert slots.SlotDecoder(model, 4, 1000).capacity == 1000


def test_the_context_length_of_zaya_serve():
    from zaya.core.errors import ConfigError
    from zaya.serve.limits import DEFAULT_MAX_MODEL_LEN, context_length

    assert context_length(None, HUGE) == DEFAULT_MAX_MODEL_LEN == 8192
    assert context_length(None, 4096) == 4096 and context_length(100, 4096) == 100
    assert context_length(None, HUGE, cap=None) == HUGE
    for bad in (0, 4097):
        with pytest.raises(ConfigError, match=f"--max-model-len {bad}: .* max_seq_len .4,096."):
            context_length(bad, 4096)


def test_zaya_serve_refuses_slots_that_do_not_fit(huge_context, capsys, monkeypatch):
    import zaya.serve.server as server
    from zaya.cli import main

    monkeypatch.setattr(server, "build_app", lambda *a, **k: pytest.fail("the server started"))
    args = ["serve", "--checkpoint", str(huge_context), "--device", "cpu", "--port", "1"]
    assert main([*args, "--max-model-len", str(LONG)]) == 2
    err = capsys.readouterr().err
    assert "16 slot(s) of 1,000,000,000 tokens need" in err and "bytes" in err
    assert "pass fewer --max-num-seqs (now 16), a smaller --max-model-len (now 1000000000)" in err
    assert "Traceback" not in err
    # the default context is capped at 8192 tokens: enough slots of it still do not fit
    assert main([*args, "--slots", str(10**8)]) == 2
    err = capsys.readouterr().err
    assert "100000000 slot(s) of 8,192 tokens need" in err and "(now 8192)" in err
    assert main([*args, "--max-model-len", str(LONG + 1)]) == 2
    assert "--max-model-len 1000000001: give the tokens each slot holds" in capsys.readouterr().err


def test_zaya_generate_refuses_a_cache_that_does_not_fit(huge_context, capsys):
    from zaya.cli import main

    code = main(["generate", "--checkpoint", str(huge_context), "--device", "cpu", "--prompt", "ROMEO:",
                 "--max-new-tokens", str(HUGE)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "1 slot(s) of 1,099,511,62" in err and f"ask for fewer --max-new-tokens (now {HUGE})" in err


def test_zaya_eval_tasks_refuses_slots_that_do_not_fit(huge_context, capsys):
    """lm-eval's engine holds the model's max_seq_len in each of its 8 slots unless --max-model-len says less."""
    pytest.importorskip("lm_eval")
    from zaya.cli import main

    code = main(["eval", "--checkpoint", str(huge_context), "--device", "cpu", "--tasks", "none_needed"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "8 slot(s) of 1,000,000,000 tokens need" in err and "smaller --max-model-len (now 1000000000)" in err


def test_zaya_serve_passes_its_memory_and_compile_flags(huge_context, monkeypatch, capsys):
    import zaya.serve.server as server
    from zaya.cli import main

    seen = {}
    monkeypatch.setattr(server, "serve", lambda *a, **k: seen.update(k))
    args = ["serve", "--checkpoint", str(huge_context), "--device", "cpu", "--port", "1"]
    assert main(args) == 0
    assert (seen["num_slots"], seen["kv_cache_memory"], seen["block_size"], seen["prefix_caching"],
            seen["compile"]) == (16, None, 16, True, False)  # auto: no compile on a CPU
    assert main([*args, "--max-num-seqs", "3", "--kv-cache-memory", "64M", "--block-size", "32",
                 "--no-prefix-caching", "--compile", "on"]) == 0
    assert (seen["num_slots"], seen["kv_cache_memory"], seen["block_size"], seen["prefix_caching"],
            seen["compile"]) == (3, 64 << 20, 32, False, True)
    assert main([*args, "--kv-cache-memory", "lots"]) == 2
    assert "--kv-cache-memory: 'lots' is not a size" in capsys.readouterr().err


def test_a_kv_pool_too_small_for_one_block_is_refused():
    from zaya.core.errors import ConfigError
    from zaya.serve.kv_budget import kv_blocks

    model = served_model(vocab_size=512, max_seq_len=64)
    assert kv_blocks(model, 4, 64, 16, None, True) == 4 * 4 + 1  # everything fits: every slot's whole context
    assert kv_blocks(model, 4, 64, 16, 10**9, True) == 17  # never more than that
    with pytest.raises(ConfigError, match=r"--kv-cache-memory 100 bytes holds 0 KV block\(s\) of 16 tokens"):
        kv_blocks(model, 4, 64, 16, 100, True)
