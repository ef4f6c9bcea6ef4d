"""Turning chat messages into a prompt.

A tokenizer that comes with a chat template (``chat_template`` in a ``tokenizer_config.json`` beside its
``tokenizer.json``, as Hugging Face ships them) is rendered with it (Jinja, ``add_generation_prompt=True``).
Otherwise zaya's simple template, for base models trained on plain documents::

    <eos>System: {system}\n\nUser: {user}\n\nAssistant: {assistant}\n\n ... User: {user}\n\nAssistant:

The prompt starts a document (an eos id first, as ``zaya generate`` does); each message is its role's name, a colon,
a space and the content, followed by a blank line; the prompt ends with ``Assistant:``. Since a base model does not
know to stop after its turn, the simple template adds ``"\n\nUser:"`` as a stop string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SIMPLE_STOP = "\n\nUser:"
_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


@dataclass
class ChatTemplate:
    """``render(messages) -> (token ids, extra stop strings)``."""

    tokenizer: object
    jinja: str | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "ChatTemplate":
        """The tokenizer's own template when its directory has one, else the simple template."""
        source = Path(str(getattr(tokenizer, "source", "")))
        config = source.parent / "tokenizer_config.json"
        template = None
        if source.name and config.is_file():
            try:
                template = json.loads(config.read_text()).get("chat_template")
            except (OSError, ValueError):
                template = None
            if isinstance(template, list):  # several named templates: the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(tokenizer, template if isinstance(template, str) else None)

    def render(self, messages: list[dict]) -> tuple[list[int], tuple[str, ...]]:
        tok = self.tokenizer
        if self.jinja is not None:
            import jinja2

            env = jinja2.Environment(autoescape=False, trim_blocks=True, lstrip_blocks=True)
            text = env.from_string(self.jinja).render(
                messages=messages, add_generation_prompt=True, bos_token=tok.backend.id_to_token(tok.special.bos),
                eos_token=tok.backend.id_to_token(tok.special.eos))
            # the template spells special tokens as text: encode them as the special ids they are
            tok.backend.encode_special_tokens = False
            try:
                return tok.backend.encode(text, add_special_tokens=False).ids, ()
            finally:
                tok.backend.encode_special_tokens = True
        text = "".join(f"{_ROLES[m['role']]}: {m['content']}\n\n" for m in messages) + "Assistant:"
        return [tok.special.eos] + tok.encode(text), (SIMPLE_STOP,)
