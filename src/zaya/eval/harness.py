"""lm-evaluation-harness on zaya models: ``zaya eval --tasks ...``.

``ZayaLM`` implements the harness's model API (``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``) on
the serving engine (``zaya.serve.engine``), in process: every request of a call is submitted at once and the engine
batches them (continuous batching over its slots, chunked prefill), so a task runs as fast as ``zaya serve`` would
serve it, without HTTP. Scoring is a request with ``max_tokens = 0`` and prompt log-probabilities: the
continuation's log-probability is the sum over its tokens, and it is greedy when each of its tokens is the argmax.

Long inputs: a (context, continuation) pair longer than the engine's context keeps its last ``capacity`` tokens
(the harness's convention: the left of the context is cut); rolling log-likelihoods use the harness's disjoint
windows of ``capacity`` tokens. Every document starts after an eos (a prompt starts a document, as in
``zaya generate``), which is also the prefix of an empty context.
"""

from __future__ import annotations

from typing import Any

from zaya.serve.engine import Engine
from zaya.serve.request import Request
from zaya.serve.sampling import SamplingParams


def _lm_base():
    from lm_eval.api.model import LM

    return LM


class ZayaLM(_lm_base()):
    """A zaya model and tokenizer as an lm-eval ``LM``."""

    def __init__(self, model, tokenizer, num_slots: int = 8, capacity: int | None = None,
                 max_gen_toks: int = 256) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.eos = model.config.eos_token_id
        self.engine = Engine(model, num_slots=num_slots, capacity=capacity,
                             decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.capacity = self.engine.capacity
        self.max_gen_toks = max_gen_toks

    # ------------------------------------------------------------------------------------------- scoring
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), greedy) per (context ids, continuation ids)."""
        requests, cuts = [], []
        for context, continuation in pairs:
            ids = ([self.eos] + context + continuation)[-self.capacity:]
            requests.append(Request(prompt=ids, max_tokens=0, prompt_logprobs=True, logprobs=1))
            cuts.append(len(ids) - len(continuation))
        self.engine.run(requests)
        out = []
        for r, cut in zip(requests, cuts):
            lps = r.prompt_token_logprobs[cut:]
            out.append((sum(lp.logprob for lp in lps), all(lp.top[0][0] == lp.token for lp in lps)))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            # encode the context and the whole string, so that a continuation starting with a space tokenizes as
            # it would in running text
            whole = self.tokenizer.encode(context + continuation)
            ctx = self.tokenizer.encode(context)
            if whole[:len(ctx)] != ctx:
                whole = ctx + self.tokenizer.encode(continuation)
            pairs.append((ctx, whole[len(ctx):]))
        return self._score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tokenizer.encode(text), prefix_token=self.eos, max_seq_len=self.capacity - 1,
                context_len=1)]
            # windows carry their own prefix (the eos for the first): score them without another one
            scored = self._score_windows(windows)
            out.append(sum(scored))
        return out

    def _score_windows(self, windows: list[tuple[list[int], list[int]]]) -> list[float]:
        requests, cuts = [], []
        for context, continuation in windows:
            ids = (context + continuation)[-self.capacity:]
            requests.append(Request(prompt=ids, max_tokens=0, prompt_logprobs=True))
            cuts.append(len(ids) - len(continuation))
        self.engine.run(requests)
        return [sum(lp.logprob for lp in r.prompt_token_logprobs[cut:]) for r, cut in zip(requests, cuts)]

    # ------------------------------------------------------------------------------------------- generation
    def generate_until(self, requests) -> list[str]:
        batch = []
        for req in requests:
            context, kwargs = req.args
            kwargs: dict[str, Any] = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0))
            if not kwargs.pop("do_sample", temperature > 0):
                temperature = 0.0
            sampling = SamplingParams(temperature=temperature, top_k=kwargs.pop("top_k", None),
                                      top_p=kwargs.pop("top_p", None), seed=kwargs.pop("seed", 1234))
            ids = ([self.eos] + self.tokenizer.encode(context))
            max_tokens = min(max_tokens, max(1, self.capacity - 1))
            ids = ids[-(self.capacity - max_tokens):]
            batch.append(Request(prompt=ids, max_tokens=max_tokens, sampling=sampling, stop=tuple(until),
                                 eos_token_id=self.eos))
        self.engine.run(batch)
        return [r.text for r in batch]


def evaluate_tasks(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                   num_fewshot: int | None = None, num_slots: int = 8, capacity: int | None = None) -> dict:
    """``lm_eval.simple_evaluate`` of ``tasks`` on the model; the harness's results dict (``results`` per task).
    ``capacity``: the tokens each of the engine's slots holds (default the model's max_seq_len)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm = ZayaLM(model, tokenizer, num_slots=num_slots, capacity=capacity)  # its slots first: checked, not indexed
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                   log_samples=False, bootstrap_iters=0)
