"""Hugging Face tokenizers in zaya's data path: the files that travel with one."""

from __future__ import annotations

import os

import pytest

from zaya.data.tokenizer import TOKENIZER_FILES, TokenizerError, copy_tokenizer_files


def test_copy_tokenizer_files_copies_those_present(tmp_path):
    src, dst = tmp_path / "model", tmp_path / "out"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"model": {}}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "config.json").write_text("{}")  # a model file, not a tokenizer's: stays behind
    assert copy_tokenizer_files(src, dst) == ["tokenizer.json", "chat_template.jinja"]
    assert sorted(p.name for p in dst.iterdir()) == ["chat_template.jinja", "tokenizer.json"]
    assert (dst / "chat_template.jinja").read_text() == "{{ messages }}"
    assert set(TOKENIZER_FILES) >= {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


def test_copy_tokenizer_files_refuses_what_is_not_a_regular_file(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    os.mkfifo(src / "tokenizer_config.json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: cannot copy.*not a regular file"):
        copy_tokenizer_files(src, tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer_config.json").exists()


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    from data_helpers import gemma_like_tokenizer

    return gemma_like_tokenizer(tmp_path_factory.mktemp("gemma"))


def _compare_with_transformers(directory, strings) -> dict[str, int]:
    """Mismatches between zaya and transformers' AutoTokenizer over ``strings``: a document's ids (zaya keeps text
    that spells a special token as text: transformers' split_special_tokens), a text whose special tokens are
    tokens (a chat template's output), and decoding."""
    from transformers import AutoTokenizer

    from zaya.data.tokenizer import Tokenizer

    hf, tok = AutoTokenizer.from_pretrained(str(directory)), Tokenizer.from_file(directory)
    as_text = hf(strings, split_special_tokens=True)["input_ids"]
    as_specials = hf(strings)["input_ids"]
    mismatches = {"text": 0, "specials": 0, "decode": 0}
    for s, text_ids, special_ids in zip(strings, as_text, as_specials):
        ids = tok.encode(s)
        mismatches["text"] += tok.prefix_ids + ids != text_ids
        mismatches["specials"] += tok.prefix_ids + tok.encode_fast(s, special_tokens=True) != special_ids
        mismatches["decode"] += tok.decode(ids) != hf.decode(ids) or ("▁" not in s and tok.decode(ids) != s)
    return mismatches


def test_a_gemma_kind_tokenizer_gives_transformers_ids(gemma_dir):
    """1,000 generated strings (unicode with astral characters and combining marks, whitespace runs, special-token
    spellings, empty) give the ids AutoTokenizer gives, the <bos> first; byte fallback decodes back to the text
    (a literal "▁" decodes as a space, in transformers too)."""
    from data_helpers import tokenizer_test_strings

    from zaya.data.tokenizer import Tokenizer

    tok = Tokenizer.from_file(gemma_dir)
    assert (tok.special.pad, tok.special.eos, tok.special.bos, tok.prefix_ids) == (0, 1, 2, [2])
    assert tok.encode("𝄞") == [tok.backend.token_to_id(f"<0x{b:02X}>") for b in "𝄞".encode()]  # byte fallback
    assert _compare_with_transformers(gemma_dir, tokenizer_test_strings(1000)) == {"text": 0, "specials": 0,
                                                                                   "decode": 0}


@pytest.mark.slow
def test_a_gemma_kind_tokenizer_gives_transformers_ids_on_10000_strings(gemma_dir):
    """The figure in benchmarks/results.md: 10,000 generated strings, no mismatch."""
    import time

    from data_helpers import tokenizer_test_strings

    start = time.perf_counter()
    mismatches = _compare_with_transformers(gemma_dir, tokenizer_test_strings(10_000, seed=1))
    print(f"\n10,000 strings: mismatches {mismatches} ({time.perf_counter() - start:.1f} s)")
    assert mismatches == {"text": 0, "specials": 0, "decode": 0}


def test_special_tokens_come_from_the_configuration_beside_the_tokenizer(gemma_dir, tmp_path):
    """tokenizer_config.json names the special tokens, else special_tokens_map.json, else the usual names; a flag
    overrides both; a name the vocabulary lacks is an error naming the file and the fix."""
    import json
    import shutil

    from zaya.data.tokenizer import Tokenizer, TokenizerError

    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(gemma_dir / "tokenizer.json", d / "tokenizer.json")
    assert Tokenizer.from_file(d).special.eos == 1  # no configuration: <eos> by name
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<end_of_turn>"}}))
    end_of_turn = Tokenizer.from_file(d).backend.token_to_id("<end_of_turn>")
    assert Tokenizer.from_file(d / "tokenizer.json").special.eos == end_of_turn
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<start_of_turn>", "pad_token": "<eos>"}))
    tok = Tokenizer.from_file(d)
    assert (tok.special.eos, tok.special.pad) == (tok.backend.token_to_id("<start_of_turn>"), 1)
    assert Tokenizer.from_file(d, eos="<eos>").special.eos == 1
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(TokenizerError, match="bos token '<s>'.*tokenizer_config.json.*--bos-token"):
        Tokenizer.from_file(d)
    with pytest.raises(TokenizerError, match="a directory without a tokenizer.json"):
        Tokenizer.from_file(tmp_path)


def test_prefix_ids_and_with_prefix(gemma_dir):
    """Gemma's post-processor puts <bos> before a text, zaya's BPE nothing; ``with_prefix`` adds it once."""
    from data_helpers import tiny_tokenizer

    from zaya.data.tokenizer import Tokenizer

    tok = Tokenizer.from_file(gemma_dir)
    assert tok.with_prefix([7, 8]) == [2, 7, 8] and tok.with_prefix([2, 7]) == [2, 7] and tok.with_prefix([]) == [2]
    assert tiny_tokenizer().prefix_ids == [] and tiny_tokenizer().with_prefix([2, 1]) == [2, 1]
