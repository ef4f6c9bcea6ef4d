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
``developer`` role is a ``system`` message to the template, as OpenAI treats it for models without its own. Limits that depend
on the server (token ids within its vocabulary, prompts per request, the context length) are checked by
``zaya.serve.server``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr

from zaya.serve.sampling import SEED_RANGE

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_TEMPERATURE = 100.0
"""Far past uniform already: logits over 100 differ by little."""
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_RANGE = (-2.0, 2.0)
"""OpenAI's range for ``presence_penalty`` and ``frequency_penalty``."""
MAX_LOGPROBS = 20


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart]
    name: Text | None = None

    def for_template(self) -> dict:
        """The message as the chat template takes it: text content (parts joined), ``developer`` as ``system``."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


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
