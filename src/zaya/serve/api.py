"""The OpenAI-compatible request bodies ``zaya serve`` accepts, and its error type.

Bodies are validated strictly: an unknown field, a wrong type (a string where a number goes, a float for an
integer, a number for a boolean) or an out-of-range value is a 400 with OpenAI's error body
(``{"error": {"message", "type", "param", "code"}}``, ``code`` in OpenAI's words: ``describe_validation_error``),
never a silent default. Every accepted value can be served:
numbers are finite (``NaN`` / ``Infinity``, which Python's JSON reader takes, are refused) and bounded, so none
makes a non-finite probability (a temperature below ``MIN_TEMPERATURE`` is greedy); a seed is in [0, 2**63);
text holds no unpaired surrogate (``"\ud800"`` is valid JSON but no UTF-8 text). Extensions beyond OpenAI's fields:
``top_k`` and ``repetition_penalty``; ``ignore_eos`` (keep generating past an end of document). Chat content is a
string or a list of text parts (joined); another part type (an image, audio) is refused, naming it. The
``developer`` role is a ``system`` message to the template, as OpenAI treats it for models without its own. Chat
takes ``response_format`` (text, json_object, json_schema), ``tools`` (at most ``MAX_TOOLS`` functions) and
``tool_choice``, and ``tool`` messages and assistant ``tool_calls`` in the conversation (``zaya.serve.tools``,
``zaya.serve.structured``). Limits that depend
on the server (token ids within its vocabulary, prompts per request, the context length) are checked by
``zaya.serve.server``.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr,
                      model_validator)

from zaya.serve.sampling import SEED_RANGE

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_TEMPERATURE = 100.0
"""Far past uniform already: logits over 100 differ by little."""
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_RANGE = (-2.0, 2.0)
"""OpenAI's range for ``presence_penalty`` and ``frequency_penalty``."""
MAX_LOGPROBS = 20
MAX_TOOLS = 64
"""Functions declared in one request (``tools``), and tool calls in one message."""


def _utf8(text: str) -> str:
    """Refuse a string Python holds but UTF-8 cannot: one with an unpaired surrogate (``"\ud800"`` in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds an unpaired surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}); "
                         "send valid Unicode text") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_utf8)]
StopText = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS), AfterValidator(_utf8)]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
"""A finite JSON number (an int is taken as a float; a bool or a string is refused)."""
Name = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
"""A function's or a response format's name, as OpenAI restricts it."""


class APIError(Exception):
    """An error the API reports as ``status`` with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    temperature: Number = Field(1.0, ge=0, le=MAX_TEMPERATURE, description="0 (or below 1e-5) = greedy")
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0, description="0 = off (an extension); >= the vocabulary = off")
    repetition_penalty: Number = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                       description="1 = off (an extension)")
    presence_penalty: Number = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: Number = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    seed: StrictInt | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=1, description="one choice per prompt")
    ignore_eos: StrictBool = False
    user: Text | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or a list of lists
    of token ids (one choice each). ``max_tokens = 0`` with ``echo`` and ``logprobs`` scores the prompt."""

    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt = Field(16, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)


def _text_part(kind: str) -> str:
    if kind != "text":
        raise ValueError(f"content parts of type {kind!r} are not served: this model takes text parts only")
    return kind


class ContentPart(BaseModel):
    """One part of a message's content: ``{"type": "text", "text": ...}`` (the only type served)."""

    model_config = ConfigDict(extra="forbid")
    type: Annotated[StrictStr, AfterValidator(_text_part)]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Text
    """JSON text, as OpenAI sends it back."""


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant message."""

    model_config = ConfigDict(extra="forbid")
    id: Text
    type: Literal["function"]
    function: CalledFunction

    def for_template(self) -> dict:
        """As Hugging Face chat templates take it: the arguments as an object when they parse as one."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    """A message; ``tool_calls`` on an assistant message only (its content may then be null), ``tool_call_id``
    on a ``tool`` message (the result of that call) only."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (the call it answers)" if self.role == "tool" else
                             f"tool_call_id belongs to tool messages, not {self.role!r} ones")
        return self

    def for_template(self) -> dict:
        """The message as the chat template takes it: text content (parts joined), ``developer`` as ``system``,
        tool calls with their arguments as objects."""
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    description: Text | None = None
    parameters: dict | None = None
    """A JSON schema of the arguments object (none: the function takes no arguments)."""
    strict: StrictBool | None = None
    """Accepted; a forced call (``tool_choice`` required or named) is always held to its schema."""


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Name
    description: Text | None = None
    json_schema: dict = Field(alias="schema")
    strict: StrictBool | None = None
    """Accepted; the schema is always enforced."""


class ResponseFormat(BaseModel):
    """``text`` (the default), ``json_object`` (any JSON object) or ``json_schema`` (a value its schema
    validates)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> "ResponseFormat":
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def check_tools(self) -> None:
        """``APIError`` for tools with a name twice, or a ``tool_choice`` they cannot meet."""
        names = [t.function.name for t in self.tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise APIError(400, f"tools: the function {twice[0]!r} is declared twice", param="tools",
                           code="invalid_value")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice: names the function {choice.function.name!r}, which tools does not "
                                "declare", param="tool_choice.function.name", code="invalid_value")
        if choice == "required" and not names:
            raise APIError(400, "tool_choice: 'required' needs tools", param="tool_choice", code="invalid_value")

    @property
    def choice(self) -> str:
        """How tools are used: ``none`` (no tools, or ``tool_choice: none``), ``auto``, ``required``, or the name
        of the function to call."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def tool_names(self) -> set[str]:
        """The functions a reply may call (none with ``tool_choice: none``)."""
        return set() if self.choice == "none" else {t.function.name for t in self.tools}

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (OpenAI's and transformers' shape), none with
        ``tool_choice: none``."""
        if self.choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def error_code(kind: str) -> str:
    """OpenAI's ``code`` for a pydantic error type: ``unknown_parameter``, ``missing_required_parameter``,
    ``invalid_type`` (a value of the wrong JSON type) or ``invalid_value``."""
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith("_type") or kind in ("int_from_float", "bool_parsing", "int_parsing", "float_parsing"):
        return "invalid_type"
    return "invalid_value"


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None, str | None]:
    """(message, param, code) for pydantic's errors about a body: the most telling one (a bad value before a type
    mismatch among a union's alternatives), its location as the field path (``messages.0.content``), and OpenAI's
    code for it (``error_code``; ``invalid_json`` for a body that is no JSON object, with no param)."""
    if not errors:
        return "the body is invalid", None, "invalid_json"
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    # a union's alternatives appear in the location as tags such as "list[int]": not part of the field's path
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not (isinstance(p, str) and "[" in p)]
    kind = str(first.get("type", ""))
    path = ".".join(loc) or None
    if kind == "json_invalid":  # its location is the character offset, no field
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", None, "invalid_json"
    if not loc:
        return "the body must be a JSON object, sent with 'content-type: application/json'", None, "invalid_json"
    if kind == "extra_forbidden":
        return f"unknown field {path!r}", path, error_code(kind)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{path}: {message}", path, error_code(kind)
