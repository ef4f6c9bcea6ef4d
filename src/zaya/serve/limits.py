"""What one client may ask of ``zaya serve``: the limits, each a flag of the command (docs/serving.md, "The
server's limits").

A module of its own, without the web stack, so that ``zaya``'s argument parser takes its defaults from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zaya.core.errors import ConfigError

DEFAULT_MAX_MODEL_LEN = 8192
"""``--max-model-len``'s default cap: every slot holds its whole context (KV cache) from the start, so the model's
own max_seq_len (131,072 for a long-context stage, 2**40 in a hostile config) would reserve that for each of the
``--slots``. A longer context is asked for with the flag, and checked against the memory available."""


def context_length(requested: int | None, max_seq_len: int, cap: int | None = DEFAULT_MAX_MODEL_LEN) -> int:
    """The tokens each slot holds (``--max-model-len``): ``requested``, or the model's ``max_seq_len`` capped at
    ``cap`` (None: not capped); ``ConfigError`` for a value below 1 or past the model's ``max_seq_len``."""
    if requested is None:
        return max_seq_len if cap is None else min(max_seq_len, cap)
    if requested < 1 or requested > max_seq_len:
        raise ConfigError(f"--max-model-len {requested}: give the tokens each slot holds, from 1 to the model's "
                          f"max_seq_len ({max_seq_len:,})")
    return requested


@dataclass(frozen=True)
class ServeLimits:
    """What one client may ask of the server; each is a ``zaya serve`` flag (docs/serving.md)."""

    api_key: str | None = None
    """``--api-key``: when set, every route but /health needs ``Authorization: Bearer KEY``."""
    max_body_bytes: int = 4 << 20
    """``--max-body-bytes``: a larger request body is refused (413) as soon as it passes this while being read."""
    max_prompts: int = 32
    """``--max-prompts``: prompts in one /v1/completions request (a list of prompts: one choice each)."""
    template_timeout: float = 2.0
    """``--template-timeout``: seconds a chat template may take to render one request."""
    shutdown_timeout: float = 3.0
    """``--shutdown-timeout``: on SIGTERM/SIGINT, seconds running requests get before they are cancelled."""

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key is empty: give a key, or leave it out (and $ZAYA_API_KEY unset)")
        for name in ("max_body_bytes", "max_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, not {value!r}")
        for name in ("template_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds > 0, not {value!r}")

    @property
    def template_chars(self) -> int:
        """The longest rendered chat prompt (characters): four times the body limit (the messages are in it)."""
        return 4 * self.max_body_bytes
