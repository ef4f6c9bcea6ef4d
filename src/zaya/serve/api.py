"""The OpenAI-compatible request bodies ``zaya serve`` accepts, and its error type.

Bodies are validated strictly: an unknown field, a wrong type (a string where a number goes, a float for an
integer, a number for a boolean) or an out-of-range value is a 400 with an OpenAI-style error body
(``{"error": {"message", "type", "param", "code"}}``), never a silent default. Extensions beyond OpenAI's fields:
``top_k`` and ``repetition_penalty``; ``ignore_eos`` (keep generating past an end of document).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictFloat, StrictInt]


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

    model: StrictStr | None = None
    temperature: Number = Field(1.0, ge=0)
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0, description="0 = off (an extension)")
    repetition_penalty: Number = Field(1.0, gt=0, description="1 = off (an extension)")
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=1, description="one choice per prompt")
    ignore_eos: StrictBool = False
    user: StrictStr | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or a list of lists
    of token ids (one choice each). ``max_tokens = 0`` with ``echo`` and ``logprobs`` scores the prompt."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt = Field(16, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = None


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
