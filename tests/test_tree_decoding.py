"""Tree-attention decoding over a sharded KV cache (``zaya.serve.tree``) against one process's decoding.

Every rank builds the same tiny random fp32 model (same seed, then ``perturb``) and decodes the same tokens; the
test process decodes them with ``model.new_state`` / ``model.generate`` alone. Tolerance: 1e-5 absolute and
relative on logits of O(1): the sharded path reorders fp32 sums (the softmax split over ranks and merged, masked
instead of causal attention in the prefill), which at these sizes moves logits by about 1e-7 (seen: at most 3e-7);
1e-5 is the bar ``tests/test_model.py`` sets for decode-equals-forward. Generated tokens must be identical.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port, run_ok
from model_helpers import perturb, tiny_config, tiny_model
from zaya.cli import main
from zaya.distributed.runtime import Runtime
from zaya.serve.tree import (METHODS, ShardedDecoder, local_attention, merge_pieces, pack, slice_bounds,
                                    tree_generate)
from zaya.model import ZayaForCausalLM
from zaya.serve.generate import generate

ROOT = Path(__file__).resolve().parents[1]
ATOL = RTOL = 1e-5
NEW = 5
"""Tokens fed after each prompt in the logits cases."""
CASES = {
    # world: [(model overrides, prompt length)]; short prompts leave the first ranks without keys
    1: [({}, 6)],
    2: [({}, 9), (dict(attention="gqa", router="linear"), 4)],
    3: [({}, 7), (dict(attention="mha", num_kv_heads=4, router_eda=False), 2)],
    4: [({}, 3), ({}, 1), ({}, 10)],
}


def build_model(overrides: dict, seed: int = 3) -> ZayaForCausalLM:
    model = tiny_model(**overrides).eval()
    perturb(model, seed=seed)
    return model


def tokens(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(length))


def sharded_logits(model, runtime, ids: torch.Tensor, prompt: int, method: str) -> list[torch.Tensor]:
    """Logits after the prompt ``ids[:, :prompt]`` and after each of the following tokens, sharded."""
    decoder = ShardedDecoder(model, runtime, method)
    out = [decoder.prefill(ids[:, :prompt], ids.shape[1] - prompt)]
    out += [decoder.step(ids[:, i]) for i in range(prompt, ids.shape[1])]
    return out


@torch.no_grad()
def reference_logits(model, ids: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    state = model.new_state(ids.shape[0], ids.shape[1])
    out = [model(ids[:, :prompt], state=state).logits[:, -1]]
    return out + [model(ids[:, i:i + 1], state=state).logits[:, -1] for i in range(prompt, ids.shape[1])]


GENERATE = [dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=7), dict(temperature=1.0, top_p=0.9, seed=1)]
SHARDED_GENERATE = [("tree", GENERATE[0]), ("butterfly", GENERATE[1]), ("ring", GENERATE[2]),
                    ("ring-partials", GENERATE[0])]
"""What the spawned ranks generate (each case costs seconds there); one process runs every option."""


def _decode_worlds(rank: int, processes: int, ports: dict[int, int]) -> dict:
    """On each of ``processes`` spawned processes: for every world size in CASES (largest first), the ranks below
    it form a process group of that size and decode; one spawn serves every world (starting processes is what
    costs here: about 6 s a process on 2 shared cores)."""
    import torch.distributed as dist

    from zaya.distributed.runtime import start
    from zaya.serve.tree import CommStats

    results: dict = {}
    for world in sorted(ports, reverse=True):
        if rank >= world:
            continue
        os.environ.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_PORT": str(ports[world])})
        runtime = start(device="cpu")
        result: dict = {"logits": [], "generate": [], "stats": []}
        for overrides, prompt in CASES[world]:
            model = build_model(overrides)
            ids = tokens(prompt + NEW)
            for method in METHODS:
                result["logits"].append(sharded_logits(model, runtime, ids, prompt, method))
        model = build_model({})
        prompt = tokens(CASES[world][0][1])
        for method, options in SHARDED_GENERATE:
            stats = CommStats()
            result["generate"].append(tree_generate(model, runtime, prompt, 6, method=method, stats=stats, **options))
            result["stats"].append((method, stats.collectives, stats.steps, stats.bytes_sent, stats.tokens))
        # bf16 autocast (the command's default) with the first ranks holding no keys: it runs, ranks agree
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result["bf16"] = tree_generate(model, runtime, tokens(2), 4, temperature=0.0)
        results[world] = result
        dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def sharded_runs():
    worlds = [w for w in CASES if w > 1]
    return run_ok(_decode_worlds, max(worlds), {w: free_port() for w in worlds})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_decoding_matches_one_process(world, sharded_runs):
    results = [ranks[world] for ranks in sharded_runs[:world]]
    layers = tiny_config().num_layers
    expected_logits = []
    for overrides, prompt in CASES[world]:
        model = build_model(overrides)
        ref = reference_logits(model, tokens(prompt + NEW), prompt)
        expected_logits += [ref] * len(METHODS)
    model = build_model({})
    prompt = tokens(CASES[world][0][1])
    expected = [generate(model, prompt, 6, **options) for _, options in SHARDED_GENERATE]
    for r in results:
        for got, ref in zip(r["logits"], expected_logits, strict=True):
            for g, e in zip(got, ref, strict=True):
                torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
        for got, want in zip(r["generate"], expected, strict=True):
            assert torch.equal(got, want)
        # per decoded token and layer: an all-reduce pair (tree), log2 p exchanges (+ 2 to fold in and out the
        # ranks past the largest power of 2: butterfly), p - 1 rounds (rings); and the token's broadcast
        rounds = {"tree": 2, "butterfly": {2: 1, 3: 3, 4: 2}[world], "ring": world - 1, "ring-partials": world - 1}
        for method, collectives, steps, sent, fed in r["stats"]:
            assert fed == 5 and collectives == fed * layers * rounds[method] + 6, method
            assert sent > 0
            if method == "tree":  # gloo: beyond 2 ranks each all-reduce goes by recursive doubling (its rounds)
                per_all_reduce = {2: 1, 3: 3, 4: 2}[world]
                broadcasts = 6 * math.ceil(math.log2(world))
                assert steps == fed * layers * 2 * per_all_reduce + broadcasts, (world, steps)
    # every rank decodes the same bits
    assert results[0]["bf16"].shape == (2, 6)
    for r in results[1:]:
        assert torch.equal(r["bf16"], results[0]["bf16"])
        for got, first in zip(r["logits"], results[0]["logits"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True))


def test_one_rank_is_plain_decoding():
    """World 1 (no process group): the same path, no collectives."""
    runtime = Runtime()
    for overrides, prompt in CASES[1]:
        model = build_model(overrides)
        ids = tokens(prompt + NEW)
        ref = reference_logits(model, ids, prompt)
        for method in METHODS:
            for got, want in zip(sharded_logits(model, runtime, ids, prompt, method), ref, strict=True):
                torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    model = build_model({})
    prompt = tokens(4)
    for options in GENERATE:
        assert torch.equal(tree_generate(model, runtime, prompt, 7, eos_token_id=5, **options),
                           generate(model, prompt, 7, eos_token_id=5, **options))


def test_slices_put_the_prompt_end_on_the_last_rank():
    assert [slice_bounds(3, 4, r) for r in range(4)] == [(0, 0), (0, 1), (1, 2), (2, 3)]
    assert [slice_bounds(10, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert [slice_bounds(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]


def test_merges_of_partials_equal_attention_over_all_keys():
    """The tree formula and the pairwise merge, with an empty partial (o = 0, lse = -finfo.max) in every place."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g),
               torch.randn(2, 2, 12, 8, generator=g))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    want_lse = torch.logsumexp(torch.einsum("bhgtd,bhsd->bhgts", q.view(2, 2, 2, 1, 8), k) / 8 ** 0.5, -1)
    parts = [local_attention(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 0), (0, 5), (5, 12))]
    m = torch.stack([lse for _, lse in parts]).amax(0)
    num = sum(o * torch.exp(lse - m)[..., None] for o, lse in parts)
    den = sum(torch.exp(lse - m)[..., None] for _, lse in parts)
    torch.testing.assert_close(num / den, want, atol=1e-6, rtol=1e-6)
    empty, first, second = (pack(*p) for p in parts)
    for order in ((empty, first, second), (first, empty, second), (first, second, empty), (second, empty, first)):
        out = order[0]
        for piece in order[1:]:
            out = merge_pieces(out, piece)
        torch.testing.assert_close(out[..., :-1], want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out[..., -1], want_lse.reshape(2, 4, 1), atol=1e-6, rtol=1e-6)
    both_empty = merge_pieces(empty, empty)
    assert torch.equal(both_empty[..., :-1], torch.zeros_like(want)) and (both_empty[..., -1] < -1e38).all()


def test_errors_name_the_fix():
    model = build_model({})
    with pytest.raises(ValueError, match="decode method 'star'"):
        ShardedDecoder(model, Runtime(), "star")
    decoder = ShardedDecoder(model, Runtime())
    with pytest.raises(ValueError, match="before prefill"):
        decoder.step(torch.tensor([1]))
    with pytest.raises(ValueError, match="at least one token"):
        decoder.allocate(1, 0, 4)
    decoder.prefill(tokens(4, batch=1), 1)
    decoder.step(torch.tensor([1]))
    with pytest.raises(ValueError, match="larger max_new_tokens"):
        decoder.step(torch.tensor([1]))
    decoder.prefill(tokens(4, batch=1), 3)
    with pytest.raises(ValueError, match="one token per step"):
        model(tokens(2, batch=1), state=decoder.state, attention_mask=None)


# ---------------------------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random zaya checkpoint with a 320-entry BPE beside it."""
    from zaya.data.tokenizer import Tokenizer
    from zaya.model.checksums import write_checksums
    from zaya.model.io import save_checkpoint

    directory = tmp_path_factory.mktemp("tree") / "ckpt"
    text = ["Now is the winter of our discontent made glorious summer by this sun of York."] * 20
    tokenizer = Tokenizer.train(text, 320)
    model = build_model(dict(vocab_size=320, eos_token_id=tokenizer.special.eos, num_layers=2))
    save_checkpoint(model, directory)
    tokenizer.save(directory / "tokenizer.json")
    write_checksums(directory)  # the tokenizer is part of the checkpoint
    return directory


def generate_args(checkpoint, *extra: str) -> list[str]:
    return ["generate", "--checkpoint", str(checkpoint), "--prompt", "Now is the winter", "--max-new-tokens", "8",
            "--dtype", "float32", "--device", "cpu", "--seed", "3", *extra]


def test_cli_tree_parallel_through_torchrun_prints_what_one_process_does(checkpoint, capsys):
    assert main(generate_args(checkpoint)) == 0
    want = capsys.readouterr().out
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "zaya", *generate_args(checkpoint,
                                                                                          "--tree-parallel", "2",
                                                                                          "--tree-method", "butterfly")],
                         capture_output=True, text=True, env=env, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout == want  # rank 0 alone prints


def test_cli_offers_every_method():
    from zaya.cli import TREE_METHODS

    assert TREE_METHODS == METHODS


def test_cli_tree_parallel_must_match_the_world_size(checkpoint, capsys):
    assert main(generate_args(checkpoint, "--tree-parallel", "2")) == 2
    err = capsys.readouterr().err
    assert "--tree-parallel 2" in err and "torchrun --nproc-per-node 2" in err
    assert main(generate_args(checkpoint, "--tree-parallel", "0")) == 2
    assert "--tree-parallel 0" in capsys.readouterr().err


def test_cli_tree_parallel_names_the_world_torchrun_started(checkpoint, capsys, monkeypatch):
    """Under torchrun (its environment, checked before any process group starts) N must be the world size."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(generate_args(checkpoint, "--tree-parallel", "3")) == 2
    err = capsys.readouterr().err
    assert "torchrun started 2 processes" in err and "--nproc-per-node 3" in err and "--tree-parallel 2" in err
