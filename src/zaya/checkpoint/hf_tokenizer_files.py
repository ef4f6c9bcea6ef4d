"""The Hugging Face files an export writes beside its tokenizer.json: ``tokenizer_config.json``,
``special_tokens_map.json`` and ``generation_config.json``.

Without them transformers guesses a tokenizer class from the model type and adds special tokens the vocabulary does
not have. With them ``AutoTokenizer`` loads tokenizer.json as it is (its post-processor decides what goes before a
text, as ``Tokenizer.prefix_ids`` does), its bos/eos/pad are the model config's ids, and generation stops at the
model's eos. A source's own files (Gemma3's tokenizer_config.json, a released generation_config.json) keep their
fields; only what must match the model is set.
"""

from __future__ import annotations

import json
from pathlib import Path

from zaya.config import ModelConfig
from zaya.data.tokenizer import (CHAT_TEMPLATE, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, Tokenizer,
                                 read_tokenizer_config, special_token_names)
from zaya.model.hf import GENERATION_CONFIG

FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
"""The class that loads tokenizer.json as it is (transformers 5 maps it to ``TokenizersBackend``, 4.x knows it too)."""
ROLES = ("bos", "eos", "pad")


def special_tokens(tokenizer: Tokenizer, config: ModelConfig) -> dict[str, str]:
    """``{"bos_token": "<...>", ...}``: the tokenizer's spelling of the model config's bos/eos/pad ids (a role whose
    id the tokenizer does not have is left out: transformers would add it as a new token past the vocabulary)."""
    out = {}
    for role in ROLES:
        text = tokenizer.token_text(getattr(config, f"{role}_token_id"))
        if text is not None:
            out[f"{role}_token"] = text
    return out


def _set_specials(config: dict, specials: dict[str, str]) -> None:
    """Give ``config`` the model's bos/eos/pad (an entry that already names the same token keeps its form, e.g. an
    object with ``lstrip`` flags); a role the tokenizer cannot spell is removed."""
    named = special_token_names(config)
    for role in ROLES:
        key = f"{role}_token"
        if key not in specials:
            config.pop(key, None)
        elif named.get(key) != specials[key]:
            config[key] = specials[key]


def write_hf_tokenizer_files(directory: Path, tokenizer: Tokenizer, config: ModelConfig,
                             default_template: str | None = None) -> list[str]:
    """Write (or complete, where the tokenizer's files were copied into ``directory`` already) the three files;
    returns their names. ``default_template``: the chat template to give a tokenizer that brings none."""
    specials = special_tokens(tokenizer, config)
    tok_config = read_tokenizer_config(directory / TOKENIZER_CONFIG)
    tok_config.setdefault("tokenizer_class", FAST_TOKENIZER_CLASS)
    _set_specials(tok_config, specials)
    tok_config["add_bos_token"] = bool(tokenizer.prefix_ids)
    tok_config["model_max_length"] = config.max_seq_len
    if "chat_template" not in tok_config and not (directory / CHAT_TEMPLATE).is_file() and default_template:
        tok_config["chat_template"] = default_template

    special_map = read_tokenizer_config(directory / SPECIAL_TOKENS_MAP)
    _set_specials(special_map, specials)

    generation = read_tokenizer_config(directory / GENERATION_CONFIG)
    eos = generation.get("eos_token_id")
    if not (isinstance(eos, list) and eos and eos[0] == config.eos_token_id):
        generation["eos_token_id"] = config.eos_token_id  # a released list (Gemma3's [1, 106]) is kept when it agrees
    generation.update(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id)
    generation.setdefault("do_sample", False)

    written = {TOKENIZER_CONFIG: tok_config, SPECIAL_TOKENS_MAP: special_map, GENERATION_CONFIG: generation}
    for name, content in written.items():
        (directory / name).write_text(json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return list(written)
