"""Turning chat messages into a prompt.

The tokenizer's own chat template when its directory has one, else zaya's ``DEFAULT_TEMPLATE`` (with
``DEFAULT_STOP`` and ``TOOL_STOP`` as stop strings, since a base model does not know to stop after its turn);
tools (OpenAI's ``tools``) go to the template as transformers passes them; found, rendered and
encoded as ``zaya.data.chat_template`` says (the prompt starts with the tokenizer's ``prefix_ids`` exactly once). A
tokenizer's template is rendered in the sandbox and the child process of ``zaya.data.template_sandbox`` (a template
is code from whoever wrote the checkpoint). A template that does not parse (compiled in the child when the server
starts), or a config that is not JSON, is a ``ConfigError`` when the server starts; a template that fails on a
request fails that request (``ChatTemplateError``), as does one whose compile passed the child's bounds. A text the
tokenizer fails on is a ``TokenizerFailure``.
"""

from __future__ import annotations

import logging

from zaya.core.errors import ConfigError
from zaya.data.chat_template import DEFAULT_STOP, TOOL_STOP, DefaultRenderer, find_template, template_variables
from zaya.data.template_sandbox import MAX_MEMORY, RenderError, TemplateProcess
from zaya.serve.prompt import encode_prompt

log = logging.getLogger("zaya.serve")


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
        self._process, self._default = None, DefaultRenderer() if jinja is None else None
        if jinja is not None:
            self._process = TemplateProcess(jinja, timeout, max_chars, max_memory)
            try:  # compiled in the bounded child only: Jinja evaluates constant expressions while compiling
                self._process.check()
            except RenderError as exc:
                if exc.kind not in ("timeout", "memory"):
                    fault = "does not parse" if exc.kind == "syntax" else "cannot be compiled"
                    line = f" on line {exc.line}" if exc.line else ""
                    raise ConfigError(f"{where}: the chat template {fault}{line} ({exc.message}); fix it, or "
                                      "remove it to serve with zaya's default template") from None
                # it parses, but compiling it passed the bounds: each chat request tries again and fails alone
                log.warning("%s: the chat template could not be compiled (%s): %s; each chat request will try "
                            "again", where, exc.kind, exc.message)

    @classmethod
    def for_tokenizer(cls, tokenizer, **limits) -> "ChatTemplate":
        """The tokenizer's own template when its directory has one, else zaya's default. ``limits``: ``timeout``
        (seconds per render), ``max_chars`` (of the rendered text), ``max_memory`` (bytes)."""
        found = find_template(getattr(tokenizer, "directory", None))
        if found is None:
            return cls(tokenizer)
        return cls(tokenizer, found.jinja, found.where, found.special_tokens, **limits)

    def render(self, messages: list[dict], capacity: int | None = None,
               tools: list[dict] | None = None) -> tuple[list[int], tuple[str, ...]]:
        """The prompt's ids and extra stop strings; with ``capacity``, a prompt certainly longer than that many
        tokens is a ``ContextLengthError`` before it is tokenized whole (``zaya.serve.prompt``)."""
        tok = self.tokenizer
        limit = capacity if capacity is not None else 1 << 62
        variables = template_variables(tok, self.special_tokens, messages, add_generation_prompt=True, tools=tools)
        try:
            text = (self._default or self._process).render(variables)
        except RenderError as exc:
            if exc.kind == "refused":
                raise ChatTemplateError(f"the chat template refused these messages: {exc.message}", True) from None
            raise ChatTemplateError(f"{self.where}: the chat template failed ({exc.kind}): {exc.message}",
                                    False) from None
        if self._default is not None:  # zaya's template writes no special token: text spelling one stays text
            return tok.with_prefix(encode_prompt(tok, text, limit)), (DEFAULT_STOP, TOOL_STOP)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a literal "\ud800" in the template, say: no text a tokenizer takes
            raise ChatTemplateError(f"{self.where}: the chat template's output is not valid Unicode (an unpaired "
                                    f"surrogate at character {exc.start})", False) from None
        return tok.with_prefix(encode_prompt(tok, text, limit, special_tokens=True)), ()

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
