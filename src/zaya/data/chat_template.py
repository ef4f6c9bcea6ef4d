"""Chat templates: zaya's default one, finding a tokenizer's own, and rendering a conversation with the assistant's
replies marked.

A Hugging Face tokenizer directory may carry a chat template (``chat_template.jinja``, or ``chat_template`` in its
``tokenizer_config.json``; of several named templates, the one named ``default``). It is code from whoever wrote the
checkpoint, so it is rendered in Jinja's sandbox inside a bounded child process (``zaya.data.template_sandbox``),
with ``bos_token`` / ``eos_token`` and the config's other ``*_token`` entries, as transformers renders it.
``DEFAULT_TEMPLATE`` is zaya's own, for tokenizers without one; being zaya's, it renders in this process (still in
the sandboxed environment). It writes no special token, so its text is encoded with text that spells one kept as
text; a tokenizer's own template writes them (``<start_of_turn>``), and its text is encoded with them as the ids
they are.

Either way the ids start with the tokenizer's ``prefix_ids`` exactly once (``Tokenizer.with_prefix``): a template
that writes ``{{ bos_token }}`` itself (Gemma's) gets no second one.

``Conversation.targets`` marks the characters of the assistant's replies: for each assistant message ``i``, from
the end of the rendering of the messages before it with ``add_generation_prompt`` to the end of the rendering of the
messages up to it, as the model would write them after the prompt (its end-of-turn marker included). That needs a
template that renders a conversation's start the same whatever follows (prefix-stable); one that does not (say, one
that drops the reasoning of earlier replies) is refused, since its replies cannot be marked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from zaya.core.errors import ConfigError
from zaya.core.fsutil import read_regular
from zaya.data.tokenizer import CHAT_TEMPLATE, TOKENIZER_CONFIG, read_tokenizer_config, special_token_names

DEFAULT_TEMPLATE = (
    "{%- if tools -%}"
    "Tools: to call a function, write <tool_call>{\"name\": NAME, \"arguments\": ARGUMENTS}</tool_call>. The "
    "functions:"
    "{%- for tool in tools -%}{{ '\\n' }}{{ tool | tojson }}{%- endfor -%}"
    "{{ '\\n\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ('system', 'user', 'assistant', 'tool') -%}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ ': use system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>"
    "{%- endfor -%}"
    "{{ '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}")
"""zaya's chat template, for base models trained on plain documents: each message is its role's name, a colon, a
space and the content, then a blank line; a prompt ends with ``Assistant:``. With ``tools`` (OpenAI's and
transformers' shape: ``{"type": "function", "function": {"name", "description", "parameters"}}``) a first block
``Tools:`` states the call convention and lists them, one JSON per line; an assistant message's ``tool_calls``
follow its content as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` each (``zaya.serve.tools``), and
a tool's result is a ``Tool:`` message."""
DEFAULT_STOP = "\n\nUser:"
"""A base model does not know to stop after its turn: serving with ``DEFAULT_TEMPLATE`` stops at this string (and
at ``TOOL_STOP``: a model that called a tool waits for its result)."""
TOOL_STOP = "\n\nTool:"
ROLES = ("system", "user", "assistant")
MAX_TEMPLATE_BYTES = 1 << 20
"""The largest chat_template.jinja read (real ones are a few KB)."""


class Renderer(Protocol):
    def render(self, variables: dict) -> str: ...


class DefaultRenderer:
    """``DEFAULT_TEMPLATE``, compiled once in this process's sandboxed environment (zaya's own: no child needed)."""

    def __init__(self) -> None:
        from zaya.data.template_sandbox import compile_template

        self._template = compile_template(DEFAULT_TEMPLATE)

    def render(self, variables: dict) -> str:
        from zaya.data.template_sandbox import RenderError, TemplateRefused

        try:
            return self._template.render(**variables)
        except TemplateRefused as exc:
            raise RenderError("refused", str(exc)) from None


@dataclass(frozen=True)
class TemplateSource:
    """A tokenizer directory's chat template: its Jinja text, where it came from, and the config's special token
    names (``bos_token`` ... as the template sees them)."""

    jinja: str
    where: str
    special_tokens: dict[str, str]


def find_template(directory: Path | None) -> TemplateSource | None:
    """The chat template of a Hugging Face tokenizer directory, or None when it has none (or there is no directory).
    A file that cannot be read, or a ``chat_template`` that is no template, is a ConfigError naming it."""
    if directory is None or not directory.is_dir():
        return None
    config = read_tokenizer_config(directory / TOKENIZER_CONFIG)
    special = special_token_names(config)
    path = directory / CHAT_TEMPLATE
    if path.exists():
        try:
            return TemplateSource(read_regular(path, MAX_TEMPLATE_BYTES).decode("utf-8"), str(path), special)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot be read ({exc}); fix or remove it") from None
    template = config.get("chat_template")
    if template is None:
        return None
    where = f"{directory / TOKENIZER_CONFIG} (chat_template)"
    if isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(f"{where}: names the templates {sorted(map(str, named))} but none 'default', the "
                              "one zaya uses; name one of them 'default'")
        template = named["default"]
    if not isinstance(template, str):
        raise ConfigError(f"{where}: is a {type(template).__name__}, not a template string; fix or remove it")
    return TemplateSource(template, where, special)


def template_variables(tokenizer, special_tokens: dict[str, str], messages: list[dict],
                       add_generation_prompt: bool, tools: list[dict] | None = None) -> dict:
    """What a template sees, as transformers passes it: the config's special token names, the tokenizer's bos and
    eos, the messages, ``add_generation_prompt`` and ``tools`` when there are any."""
    variables = {**special_tokens, "messages": messages, "add_generation_prompt": add_generation_prompt,
                 "bos_token": tokenizer.token_text(tokenizer.special.bos),
                 "eos_token": tokenizer.token_text(tokenizer.special.eos)}
    if tools:
        variables["tools"] = tools
    return variables


def check_messages(messages: object) -> str | None:
    """Why ``messages`` is not a conversation to train on (a list of ``{"role", "content"}`` objects with roles
    system, user or assistant, string contents and at least one assistant reply), or None."""
    if not isinstance(messages, list) or not messages:
        return "'messages' is not a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {i} is not an object with 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"message {i} has role {m['role']!r} (use {', '.join(ROLES)})"
        if not isinstance(m["content"], str):
            return f"message {i} has a {type(m['content']).__name__} content, not a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message (nothing to learn from)"
    return None


class NotPrefixStable(ConfigError):
    """A chat template whose rendering of a conversation's start changes with what follows."""


@dataclass
class Conversation:
    """A rendered conversation: its text and the ``[start, end)`` character ranges of the assistant's replies."""

    text: str
    targets: list[tuple[int, int]]


def render_conversation(renderer: Renderer, variables: dict, messages: list[dict], where: str) -> Conversation:
    """Render ``messages`` whole and mark each assistant reply (see the module docstring); ``variables`` are
    ``template_variables`` less the messages. ``NotPrefixStable`` naming ``where`` when the renderings do not nest."""
    def render(upto: int, prompt: bool) -> str:
        return renderer.render({**variables, "messages": messages[:upto], "add_generation_prompt": prompt})

    text = render(len(messages), False)
    targets = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(i, True), render(i + 1, False)
        if not (after.startswith(before) and text.startswith(after)):
            raise NotPrefixStable(
                f"{where}: the chat template renders a conversation's start differently once later messages follow "
                f"(message {i}: {_first_difference(before, after, text)}), so the assistant's replies cannot be "
                "marked exactly; give the tokenizer directory a chat_template.jinja that renders every turn the same "
                "way whatever follows")
        targets.append((len(before), len(after)))
    return Conversation(text, targets)


def _first_difference(before: str, after: str, text: str) -> str:
    a, b, what = (before, after, "with the generation prompt vs with the reply") if not after.startswith(before) \
        else (after, text, "up to the reply vs the whole conversation")
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{what} differ at character {at}: {a[at:at + 20]!r} vs {b[at:at + 20]!r}"


class ConversationRenderer:
    """Conversations of one tokenizer rendered for training: with its own template (in the bounded child) when its
    directory has one, else ``DEFAULT_TEMPLATE``. ``special_tokens``: whether the text is encoded with the special
    tokens it spells as those tokens (a tokenizer's template writes them; the default writes none)."""

    def __init__(self, tokenizer, timeout: float = 10.0, max_chars: int = 1 << 26) -> None:
        from zaya.data.template_sandbox import RenderError, TemplateProcess

        found = find_template(tokenizer.directory)
        self.special_tokens = found is not None
        self.where = found.where if found else "zaya's default chat template"
        self._variables = template_variables(tokenizer, found.special_tokens if found else {}, [], False)
        if found is None:
            self._renderer: Renderer = DefaultRenderer()
            return
        process = TemplateProcess(found.jinja, timeout, max_chars)
        try:
            process.check()
        except RenderError as exc:
            process.close()
            raise ConfigError(f"{found.where}: the chat template cannot be used ({exc.kind}: {exc.message}); fix it "
                              "or remove it to use zaya's default template") from None
        self._renderer = process

    def conversation(self, messages: list[dict]) -> Conversation:
        """``messages`` rendered, the assistant's replies marked (``RenderError`` when the template fails on them)."""
        return render_conversation(self._renderer, self._variables, messages, self.where)

    def close(self) -> None:
        close = getattr(self._renderer, "close", None)
        if close is not None:
            close()


def conversation_ids(tokenizer, text: str, targets: list[tuple[int, int]],
                     special_tokens: bool) -> tuple[list[int], np.ndarray]:
    """A rendered conversation's ids (starting with ``prefix_ids`` once) and loss mask: 1 for a token holding a
    character of a target range (a token that straddles a reply's edge is the reply's), 0 elsewhere."""
    ids, offsets = tokenizer.encode_offsets(text, special_tokens)
    starts = np.fromiter((a for a, _ in offsets), np.int64, len(offsets))
    ends = np.fromiter((b for _, b in offsets), np.int64, len(offsets))
    first = np.array([a for a, _ in targets] + [len(text) + 1], np.int64)
    last = np.array([b for _, b in targets] + [len(text) + 2], np.int64)
    k = np.searchsorted(last, starts, side="right")  # the first range ending after the token starts
    mask = (first[k] < np.maximum(ends, starts + 1)).astype(np.uint8)
    full = tokenizer.with_prefix(ids)
    return full, np.concatenate([np.zeros(len(full) - len(ids), np.uint8), mask])
