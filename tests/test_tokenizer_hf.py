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
