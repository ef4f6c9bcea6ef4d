"""Turning chat messages into a prompt.

A tokenizer that comes with a chat template, as Hugging Face ships them (``chat_template.jinja`` beside its
``tokenizer.json``, or ``chat_template`` in the ``tokenizer_config.json`` there), is rendered with it: Jinja with
``add_generation_prompt=True``, ``bos_token`` / ``eos_token`` and the config's other special tokens, in the sandbox
and the child process of ``zaya.serve.template_sandbox`` (a template is code from whoever wrote the checkpoint).
A template that does not parse (compiled in the child when the server starts), or a config that is not JSON, is a
``ConfigError`` when the server starts; a template that fails on a request fails that request
(``ChatTemplateError``), as does one whose compile passed the child's bounds. The template's text is encoded with
the special tokens it spells as the special ids they are (``Tokenizer.encode_fast(special_tokens=True)``); a text
the tokenizer fails on is a ``TokenizerFailure``.

Otherwise zaya's simple template, for base models trained on plain documents::

    <eos>System: {system}\n\nUser: {user}\n\nAssistant: {assistant}\n\n ... User: {user}\n\nAssistant:

The prompt starts a document (an eos id first, as ``zaya generate`` does); each message is its role's name, a colon,
a space and the content, followed by a blank line; the prompt ends with ``Assistant:``. Since a base model does not
know to stop after its turn, the simple template adds ``"\n\nUser:"`` as a stop string.
"""

from __future__ import annotations

import logging
from pathlib import Path

from zaya.core.errors import ConfigError
from zaya.core.fsutil import read_json
from zaya.serve.prompt import encode_prompt
from zaya.serve.template_sandbox import MAX_MEMORY, RenderError, TemplateProcess

log = logging.getLogger("zaya.serve")

SIMPLE_STOP = "\n\nUser:"
_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(Exception):
    """A chat template that failed on one request. ``client_error``: the template refused the messages
    (``raise_exception``, a 400); otherwise the template itself is at fault (a 500)."""

    def __init__(self, message: str, client_error: bool) -> None:
        super().__init__(message)
        self.client_error = client_error


class ChatTemplate:
    """``render(messages) -> (token ids, extra stop strings)``; ``close()`` stops the template's child process."""

    def __init__(self, tokenizer, jinja: str | None = None, where: str = "the chat template",
                 special_tokens: dict[str, str] | None = None, timeout: float = 5.0, max_chars: int = 1 << 24,
                 max_memory: int = MAX_MEMORY) -> None:
        self.tokenizer, self.jinja, self.where = tokenizer, jinja, where
        self.special_tokens = dict(special_tokens or {})
        self._process = None
        if jinja is not None:
            self._process = TemplateProcess(jinja, timeout, max_chars, max_memory)
            try:  # compiled in the bounded child only: Jinja evaluates constant expressions while compiling
                self._process.check()
            except RenderError as exc:
                if exc.kind not in ("timeout", "memory"):
                    fault = "does not parse" if exc.kind == "syntax" else "cannot be compiled"
                    line = f" on line {exc.line}" if exc.line else ""
                    raise ConfigError(f"{where}: the chat template {fault}{line} ({exc.message}); fix it, or "
                                      "remove it to serve with zaya's simple template") from None
                # it parses, but compiling it passed the bounds: each chat request tries again and fails alone
                log.warning("%s: the chat template could not be compiled (%s): %s; each chat request will try "
                            "again", where, exc.kind, exc.message)

    @classmethod
    def for_tokenizer(cls, tokenizer, **limits) -> "ChatTemplate":
        """The tokenizer's own template when its directory has one, else the simple template. ``limits``:
        ``timeout`` (seconds per render), ``max_chars`` (of the rendered text), ``max_memory`` (bytes)."""
        source = Path(str(getattr(tokenizer, "source", "")))
        if not source.name or not source.parent.is_dir():
            return cls(tokenizer)
        directory = source.parent
        config: dict = {}
        config_path = directory / CONFIG_FILE
        if config_path.is_file():
            try:
                config = read_json(config_path)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{config_path}: cannot be read as JSON ({exc}); fix or remove it") from None
            if not isinstance(config, dict):
                raise ConfigError(f"{config_path}: holds a {type(config).__name__}, not a JSON object; fix or "
                                  "remove it")
        special = {k: v if isinstance(v, str) else v.get("content") for k, v in config.items()
                   if k.endswith("_token") and (isinstance(v, str) or isinstance(v, dict)
                                                and isinstance(v.get("content"), str))}
        template_path = directory / TEMPLATE_FILE
        if template_path.is_file():
            try:
                return cls(tokenizer, template_path.read_text(encoding="utf-8"), str(template_path), special,
                           **limits)
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{template_path}: cannot be read ({exc}); fix or remove it") from None
        template = config.get("chat_template")
        if template is None:
            return cls(tokenizer)
        where = f"{config_path} (chat_template)"
        if isinstance(template, list):  # several named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ConfigError(f"{where}: names the templates {sorted(map(str, named))} but none 'default', the "
                                  "one a chat request uses; name one of them 'default'")
            template = named["default"]
        if not isinstance(template, str):
            raise ConfigError(f"{where}: is a {type(template).__name__}, not a template string; fix or remove it")
        return cls(tokenizer, template, where, special, **limits)

    def render(self, messages: list[dict], capacity: int | None = None) -> tuple[list[int], tuple[str, ...]]:
        """The prompt's ids and extra stop strings; with ``capacity``, a prompt certainly longer than that many
        tokens is a ``ContextLengthError`` before it is tokenized whole (``zaya.serve.prompt``)."""
        tok = self.tokenizer
        limit = capacity if capacity is not None else 1 << 62
        if self._process is None:
            text = "".join(f"{_ROLES[m['role']]}: {m['content']}\n\n" for m in messages) + "Assistant:"
            return [tok.special.eos] + encode_prompt(tok, text, limit), (SIMPLE_STOP,)
        variables = {**self.special_tokens, "messages": messages, "add_generation_prompt": True,
                     "bos_token": tok.token_text(tok.special.bos), "eos_token": tok.token_text(tok.special.eos)}
        try:
            text = self._process.render(variables)
        except RenderError as exc:
            if exc.kind == "refused":
                raise ChatTemplateError(f"the chat template refused these messages: {exc.message}", True) from None
            raise ChatTemplateError(f"{self.where}: the chat template failed ({exc.kind}): {exc.message}",
                                    False) from None
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a literal "\ud800" in the template, say: no text a tokenizer takes
            raise ChatTemplateError(f"{self.where}: the chat template's output is not valid Unicode (an unpaired "
                                    f"surrogate at character {exc.start})", False) from None
        return encode_prompt(tok, text, limit, special_tokens=True), ()

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
