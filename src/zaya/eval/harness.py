"""lm-evaluation-harness on zaya models: ``zaya eval --tasks ...``.

``ZayaLM`` implements the harness's model API (``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``) on
the serving engine (``zaya.serve.engine``), in process: every request of a call is submitted at once and the engine
batches them (continuous batching over its slots, chunked prefill), so a task runs as fast as ``zaya serve`` would
serve it, without HTTP. Scoring is a request with ``max_tokens = 0`` and prompt log-probabilities: the
continuation's log-probability is the sum over its tokens, and it is greedy when each of its tokens is the argmax.

Prompts start as ``zaya generate``'s and ``zaya serve``'s do, with ``Tokenizer.prefix_ids`` (what transformers'
``tokenizer(text)`` puts first): ``ZayaLM`` is a ``TemplateLM``, so the harness itself splits (context,
continuation) pairs and gives an empty context its ``prefix_token_id``, as it does for its ``hf`` model on an export.
That prefix token is the tokenizer's own (bos for Gemma's) or, for one that puts nothing before a text (zaya's BPE),
the eos that ends the document before, which is what such a model saw before every document it trained on (lm-eval's
``hf`` model takes the bos there; its ``prefix_token_id`` model argument makes them agree).

Long inputs: a (context, continuation) pair longer than the engine's context keeps its last ``capacity`` tokens
(the harness's convention: the left of the context is cut); rolling log-likelihoods use the harness's disjoint
windows of ``capacity`` tokens after the prefix token.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from zaya.core.errors import ConfigError
from zaya.serve.engine import Engine
from zaya.serve.request import Request
from zaya.serve.sampling import SamplingParams


def _lm_base():
    from lm_eval.api.model import TemplateLM

    return TemplateLM


class ZayaLM(_lm_base()):
    """A zaya model and tokenizer as an lm-eval ``TemplateLM``."""

    def __init__(self, model, tokenizer, num_slots: int = 8, capacity: int | None = None,
                 max_gen_toks: int = 256) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.eos = model.config.eos_token_id
        self.prefix = tokenizer.prefix_ids
        self.engine = Engine(model, num_slots=num_slots, capacity=capacity,
                             decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.capacity = self.engine.capacity
        self.max_gen_toks = max_gen_toks

    # ------------------------------------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.eos

    @property
    def prefix_token_id(self) -> int:
        """The context of an empty context (see the module's docstring)."""
        return self.prefix[-1] if self.prefix else self.eos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """``string``'s ids after the tokenizer's prefix (none with ``add_special_tokens=False``)."""
        return (self.prefix if add_special_tokens is not False else []) + self.tokenizer.encode(string)

    # ------------------------------------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), greedy) per ((context, continuation), context ids, continuation
        ids), the pairs ``TemplateLM.loglikelihood`` encoded."""
        scored, cuts = [], []
        for _, context, continuation in requests:
            ids = (context + continuation)[-self.capacity:]
            scored.append(Request(prompt=ids, max_tokens=0, prompt_logprobs=True, logprobs=1))
            cuts.append(len(ids) - len(continuation))
        self.engine.run(scored)
        out = []
        for r, cut in zip(scored, cuts):
            lps = r.prompt_token_logprobs[cut:]
            out.append((sum(lp.logprob for lp in lps), all(lp.top[0][0] == lp.token for lp in lps)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tokenizer.encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.capacity - 1, context_len=1)]
            # windows carry their own context (the prefix token for the first): score them without another one
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
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
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
            ids = self.tok_encode(context)
            max_tokens = min(max_tokens, max(1, self.capacity - 1))
            ids = ids[-(self.capacity - max_tokens):]
            batch.append(Request(prompt=ids, max_tokens=max_tokens, sampling=sampling, stop=tuple(until),
                                 eos_token_id=self.eos))
        self.engine.run(batch)
        return [r.text for r in batch]


def evaluate_tasks(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                   num_fewshot: int | None = None, num_slots: int = 8, capacity: int | None = None) -> dict:
    """``lm_eval.simple_evaluate`` of ``tasks`` on the model; the harness's results dict (``results`` per task).
    ``capacity``: the tokens each of the engine's slots holds (default the model's max_seq_len). A task lm-eval
    does not know, or cannot load here (its dataset not downloaded), is a ``ConfigError`` naming it and the fix."""
    import lm_eval

    lm = ZayaLM(model, tokenizer, num_slots=num_slots, capacity=capacity)  # its slots first: checked, not indexed
    manager = manager_for(tasks, include_path)
    loaded = [task for name in tasks for task in load_task(manager, name, include_path)]
    return lm_eval.simple_evaluate(model=lm, tasks=loaded, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                   log_samples=False, bootstrap_iters=0)


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None = None, defaults: bool = True):
    """lm-eval's index of the tasks under ``include_path`` and, with ``defaults``, of its own (built once per path:
    its own are some 15,000 task files, about 20 s; ``evaluate_tasks`` looks under ``include_path`` alone first)."""
    from lm_eval.tasks import TaskManager

    if not defaults:
        return TaskManager(include_path=include_path, include_defaults=False)
    return TaskManager(include_path=include_path) if include_path else TaskManager()


def manager_for(tasks: list[str], include_path: str | None):
    """The index that has ``tasks``: the tasks under ``include_path`` alone when they are all there (a second, not
    twenty), else lm-eval's whole index."""
    if include_path:
        local = task_manager(include_path, defaults=False)
        if all(name in local.all_tasks or Path(name).is_file() for name in tasks):
            return local
    return task_manager(include_path)


def load_task(manager, name: str, include_path: str | None) -> list:
    """The task (or group) ``name`` with its documents, built by ``manager``; a ``ConfigError`` for a name it does
    not know or a task whose dataset cannot be had (no network, no cached copy)."""
    import difflib

    local = "write a task YAML whose dataset is a local file (dataset_path: json, dataset_kwargs: {data_files: ...}) " \
            "and pass its directory with --include-path DIR (docs/evaluation.md)"
    if name not in manager.all_tasks and not Path(name).is_file():
        close = difflib.get_close_matches(name, manager.all_tasks, n=3)
        where = f" or under --include-path {include_path}" if include_path else ""
        raise ConfigError(f"--tasks: {name!r} is not a task of lm-eval {_version()}{where}"
                          + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
                          + f"; `lm-eval ls tasks` lists them, or {local}")
    try:
        loaded = manager.load(name)
    except Exception as exc:  # noqa: BLE001 - datasets and the hub raise many kinds; each is this task's data
        reason = " ".join(str(exc).split())[:300]
        raise ConfigError(f"--tasks: lm-eval cannot load task {name!r} here ({type(exc).__name__}: {reason}): its "
                          "dataset is downloaded on first use; run it once where the network is reachable (the "
                          f"dataset is then cached), or {local}") from None
    return [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
