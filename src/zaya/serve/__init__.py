"""Serving: the inference engine (slots, continuous batching, chunked prefill, sampling, stops, log-probabilities)
and ``zaya serve``'s OpenAI-compatible HTTP API. See docs/serving.md.

The engine's modules (``sampling``, ``request``, ``text``, ``engine``) import no model code, so ``model.generate``
can run on them; the HTTP side (``api``, ``chat`` and ``template_sandbox``, ``gate``, ``limits``, ``prompt``,
``worker``, ``server``) sits above everything else. Nothing is imported here so that importing the engine never
pulls in the web stack.
"""
