"""An export read by the usual tools, through those tools: transformers' ``AutoTokenizer`` gives zaya's ids,
``AutoModelForCausalLM`` in a ``pipeline("text-generation")`` gives the greedy text that ``zaya generate`` and
``zaya serve``'s /v1/completions give, and lm-eval's ``hf`` model scores a request as ``zaya eval``'s does.

The model is the serving tests' tiny one on the 512-entry Shakespeare tokenizer, exported by ``zaya export`` (fp32,
the default dtype on a CPU). transformers' ``from_pretrained`` sets the skip class's balancing bias to -1 after
loading (its ``_init_weights``); zaya never moves that bias and this model has the default -1 (docs/formats.md).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.zaya")

from serve_helpers import ServerThread, served_checkpoint  # noqa: E402
from test_tokenizer_hf import _compare_with_transformers  # noqa: E402
from zaya.checkpoint.export import export  # noqa: E402
from zaya.cli import main  # noqa: E402

PROMPTS = ["ROMEO: What light", "JULIET:\nO Romeo", "To be, or not to be"]
NEW_TOKENS = 12
EXPORT_FILES = {"tokenizer_config.json", "special_tokens_map.json", "generation_config.json"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, shakespeare_dataset) -> Path:
    root = tmp_path_factory.mktemp("export-tools")
    checkpoint = served_checkpoint(root / "ckpt", shakespeare_dataset / "tokenizer.json", max_seq_len=64)
    return export(checkpoint, root / "hf")


def special_strings(n: int, seed: int = 0) -> list[str]:
    """``data_helpers.tokenizer_test_strings`` with the special tokens spelled as zaya's BPE spells them."""
    from data_helpers import tokenizer_test_strings

    spell = {"<bos>": "<|bos|>", "<eos>": "<|eos|>", "<pad>": "<|pad|>"}
    out = []
    for s in tokenizer_test_strings(n, seed):
        for gemma, zaya in spell.items():
            s = s.replace(gemma, zaya)
        out.append(s)
    return out


def test_the_export_carries_the_tokenizer_and_generation_files(exported):
    from transformers import AutoTokenizer, GenerationConfig

    from zaya.data.chat_template import DEFAULT_TEMPLATE
    from zaya.model.checksums import read_manifest
    from zaya.model.hf import load_hf

    config = load_hf(exported).config  # its SHA256SUMS lists the new files too
    assert EXPORT_FILES <= set(read_manifest(exported))
    for name in EXPORT_FILES:
        assert stat.S_IMODE((exported / name).stat().st_mode) == 0o644
    hf = AutoTokenizer.from_pretrained(str(exported))
    assert type(hf).__name__ == "TokenizersBackend" and len(hf) == 512  # no token added past the vocabulary
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (config.bos_token_id, config.eos_token_id,
                                                                   config.pad_token_id)
    assert hf.model_max_length == config.max_seq_len and hf.chat_template == DEFAULT_TEMPLATE
    generation = GenerationConfig.from_pretrained(str(exported))
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id, generation.do_sample) == (
        config.bos_token_id, config.eos_token_id, config.pad_token_id, False)
    assert json.loads((exported / "tokenizer_config.json").read_text())["add_bos_token"] is False  # prefix_ids: []


@pytest.mark.parametrize("n, seed", [(1000, 0), pytest.param(10_000, 1, marks=pytest.mark.slow)],
                         ids=["1000", "10000"])
def test_autotokenizer_gives_zayas_ids(exported, n, seed):
    """Generated strings (unicode with astral characters, whitespace runs, newlines, text spelling special tokens,
    the empty string): with and without the prefix, special-token text as text or as the tokens. The 10,000-string
    run (slow) is the figure in benchmarks/results.md."""
    import time

    start = time.perf_counter()
    mismatches = _compare_with_transformers(exported, special_strings(n, seed))
    print(f"\n{n:,} strings on an export: mismatches {mismatches} ({time.perf_counter() - start:.1f} s)")
    assert mismatches == {"text": 0, "specials": 0, "decode": 0}


def test_one_greedy_text_from_generate_serve_and_transformers(exported, capsys):
    """The same prompt gives the same greedy text from ``zaya generate`` (its default dtype on the CPU, fp32),
    ``zaya serve``'s /v1/completions and transformers' pipeline on the export (fp32)."""
    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from zaya.checkpoint.consolidate import load_for_inference
    from zaya.core.device import DTYPES, default_inference_dtype
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.engine import Engine
    from zaya.serve.server import build_app

    assert default_inference_dtype(torch.device("cpu")) == "float32"
    assert default_inference_dtype(torch.device("cuda", 0)) == "bfloat16"
    pipe = pipeline("text-generation", model=AutoModelForCausalLM.from_pretrained(str(exported),
                                                                                  dtype=torch.float32),
                    tokenizer=AutoTokenizer.from_pretrained(str(exported)), device="cpu")
    model = load_for_inference(exported, dtype=DTYPES["float32"])[0]
    tok = Tokenizer.from_file(exported)
    engine = Engine(model, num_slots=2, capacity=64, decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    with ServerThread(build_app(engine, tok, model_name="tiny")) as url:
        for prompt in PROMPTS:
            assert main(["generate", "--checkpoint", str(exported), "--prompt", prompt, "--temperature", "0",
                         "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]) == 0
            generated = capsys.readouterr().out.removesuffix("\n")
            served = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": NEW_TOKENS,
                                                                "temperature": 0}, timeout=60).json()
            hf = pipe(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
            assert generated == prompt + served["choices"][0]["text"] == hf
            assert len(generated) > len(prompt)


def test_lm_eval_hf_model_scores_as_zaya(exported):
    """lm-eval's ``hf`` model loads the export and scores (context, continuation) requests as ``ZayaLM`` does:
    the same ids (the tokenizer's prefix, none here, then the text) and the same log-probabilities, to 1e-4 (fp32
    sums of a few log-probabilities from two implementations of the forward; tests/test_hf.py measures ~1e-5 on
    logits)."""
    from lm_eval.models.huggingface import HFLM

    from zaya.checkpoint.consolidate import load_for_inference
    from zaya.data.tokenizer import Tokenizer
    from zaya.eval.harness import ZayaLM

    class Req:
        def __init__(self, *args):
            self.args = args

    requests = [Req("ROMEO: What light", " breaks"), Req("JULIET:\nO Romeo, Romeo", " wherefore"),
                Req("To be, or not ", "to be")]
    theirs = HFLM(pretrained=str(exported), device="cpu", dtype="float32", batch_size=1).loglikelihood(requests)
    ours = ZayaLM(load_for_inference(exported)[0], Tokenizer.from_file(exported), num_slots=1).loglikelihood(requests)
    for (lp_theirs, greedy_theirs), (lp_ours, greedy_ours) in zip(theirs, ours):
        assert lp_ours == pytest.approx(lp_theirs, abs=1e-4) and greedy_ours == greedy_theirs
