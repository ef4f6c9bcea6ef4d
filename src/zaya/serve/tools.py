"""Tool calls as the model writes them: the grammar that forces one, finding them in a reply, and streaming a reply
that may hold them.

The convention (zaya's default chat template shows it to the model, and it is Hermes' and Qwen's): a call is
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, a newline allowed after the opening tag and before
the closing one (and a space before it: the template writes ``Assistant: `` first); several calls follow one
another, separated by whitespace. A reply is a tool-call reply when the text from its first ``<tool_call>`` on is
nothing but complete calls whose JSON names a known function and gives an object of arguments; the text before it
is the reply's content. Anything else is content, never an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from zaya.serve.api import APIError
from zaya.serve.structured import (JSON_FORMAT, JSON_OBJECT, MAX_SCHEMA_BYTES, GrammarConstraint, GrammarError,
                                     Grammars, json_schema_grammar, schema_text)
from zaya.serve.text import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function declared without ``parameters``: an empty object, as OpenAI takes it."""


def _lark_json(schema: dict) -> str:
    """``schema`` as llguidance's Lark ``%json`` body, spelled as ``JSON_FORMAT`` says."""
    text = schema_text({**schema, "x-guidance": JSON_FORMAT})
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the grammar's schemas have {len(text.encode()):,} bytes as JSON; at most "
                           f"{MAX_SCHEMA_BYTES:,} are served")
    return text


def call_grammar(functions: list[dict], answer: dict | None = None) -> str:
    """A Lark grammar (llguidance's) for one call of one of ``functions`` (``{"name", "parameters"}`` each, as
    OpenAI declares them) whose arguments are valid for its parameters schema; with ``answer`` (a JSON schema),
    either that call or a JSON value of ``answer`` (``tool_choice: auto`` with a ``response_format``)."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or NO_ARGUMENTS}}
             for f in functions]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    rules = [f'start: {"answer | " if answer is not None else ""}call',
             f'call: " "? "{OPEN}" "\\n"? call_json "\\n"? "{CLOSE}"',
             f"call_json: %json {_lark_json(call)}"]
    if answer is not None:
        rules.append(f"answer: %json {_lark_json(answer)}")
    return "\n".join(rules) + "\n"


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments object as JSON text (OpenAI's form)."""
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def body(self, index: int | None = None) -> dict:
        """The call as a response's ``tool_calls`` entry (with ``index``: as a stream's delta carries it)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]] | None:
    """``(content, calls)`` when ``text`` is a tool-call reply (see the module docstring; content None when only
    whitespace precedes the calls), else None."""
    content, found, rest = text.partition(OPEN)
    if not found:
        return None
    calls = []
    while True:
        body, closed, rest = rest.partition(CLOSE)
        if not closed:
            return None
        try:
            call = json.loads(body)
            if not (isinstance(call, dict) and set(call) == {"name", "arguments"} and call["name"] in names
                    and isinstance(call["arguments"], dict)):
                return None
            calls.append(ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        except (ValueError, RecursionError):  # not JSON, or nested past what Python's JSON reader takes
            return None
        rest = rest.lstrip()
        if not rest:
            return (content if content.strip() else None), calls
        if not rest.startswith(OPEN):
            return None
        rest = rest[len(OPEN):]


def reply(text: str, finish_reason: str, names: set[str]) -> tuple[dict, str]:
    """A chat response's message and finish reason for the reply ``text``: its tool calls (finish reason
    ``tool_calls``) when it is a tool-call reply of one of ``names`` (none: tools are not in use), else its text."""
    parsed = parse_calls(text, names) if names else None
    if parsed is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parsed
    return {"role": "assistant", "content": content, "tool_calls": [c.body() for c in calls]}, "tool_calls"


class ReplyStream:
    """A streamed reply's deltas. With tools in use (``names``) its content is released as it grows except from
    the first ``<tool_call>`` on (or an end that may be its start), which waits for the end: the last delta then
    carries the calls whole (id, name and arguments in one ``tool_calls`` entry each, which clients assemble as
    OpenAI's fragments) or, when the reply is no tool-call reply, the rest as content."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.sent = 0

    def delta(self, text: str, done: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta after the reply so far, ``text``, and the finish reason to send (None until ``done``)."""
        if done:
            message, finish_reason = reply(text, finish_reason, self.names)
            if "tool_calls" not in message:
                return {"content": self._release(text, len(text))}, finish_reason
            delta = {"content": self._release(message["content"] or "", len(message["content"] or ""))}
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            return delta, finish_reason
        cut = text.find(OPEN) if self.names else -1
        safe = cut if cut >= 0 else len(text) - (held_back(text, (OPEN,)) if self.names else 0)
        return {"content": self._release(text, safe)}, None

    def _release(self, text: str, end: int) -> str:
        piece = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece


def chat_constraint(body, grammars: Grammars) -> GrammarConstraint | None:
    """The constraint a chat request (``zaya.serve.api.ChatRequest``) is held to, or None: a ``json_schema`` or
    ``json_object`` response format; a forced call (``tool_choice`` required or named); with ``auto``, either a
    call or the response format's JSON. A schema llguidance refuses (or too large) is an ``APIError`` naming the
    field it came from."""
    fmt, choice = body.response_format, body.choice
    answer, param = None, "tools"
    if fmt is not None and fmt.type != "text":
        answer = fmt.json_schema.json_schema if fmt.type == "json_schema" else JSON_OBJECT
        param = "response_format.json_schema.schema" if fmt.type == "json_schema" else "response_format"
        if choice not in ("none", "auto"):
            raise APIError(400, "response_format: a JSON response format goes with tool_choice none or auto only "
                                "(a forced call's reply is the call)", param="response_format", code="invalid_value")
    if answer is None and choice in ("none", "auto"):
        return None
    if body.ignore_eos:
        raise APIError(400, "ignore_eos: a constrained reply ends where its grammar ends; leave ignore_eos out with "
                            "response_format or a forced tool call", param="ignore_eos", code="invalid_value")
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools or ()]
    try:
        if choice == "none":
            grammar = json_schema_grammar(answer)
        elif choice == "auto":
            grammar = call_grammar(functions, answer)
        else:
            grammar = call_grammar(functions if choice == "required" else
                                   [f for f in functions if f["name"] == choice])
        return grammars.constraint(grammar)
    except GrammarError as exc:
        if choice not in ("none", "auto", "required"):
            param = f"tools.{[f['name'] for f in functions].index(choice)}.function.parameters"
        raise APIError(400, f"{param}: the schema is not served: {exc}", param=param, code="invalid_value") from None
