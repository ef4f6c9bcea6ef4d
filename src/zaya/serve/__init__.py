"""Serving: the inference engine (slots, continuous batching, chunked prefill, sampling, stops, log-probabilities)
and ``zaya serve``'s OpenAI-compatible HTTP API. See docs/serving.md.

The engine (``engine`` on ``sampling``, ``request``, ``text``) decodes on the model's slots; ``generate`` and tree
decoding (``tree``) run on it; the HTTP side (``api``, ``chat``, ``gate``, ``limits``,
``prompt``, ``worker``, ``server``) sits above everything else. Nothing is imported here so that importing the
engine never pulls in the web stack.
"""
