"""``zaya eval --tasks``: lm-evaluation-harness on the engine, on task files and data the test writes (no
downloads): a multiple-choice (loglikelihood), a generation (generate_until) and a perplexity
(loglikelihood_rolling) task; the scores are checked against the model's own forward."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from serve_helpers import served_checkpoint, served_model

pytest.importorskip("lm_eval")

TASKS = {
    "zaya_tiny_mc": """task: zaya_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "zaya_tiny_gen": """task: zaya_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "zaya_tiny_ppl": """task: zaya_tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
}


DOCS = [{"question": "ROMEO: What light", "choices": [" breaks", " sings", " falls"], "answer": 0},
        {"question": "JULIET: O Romeo, Romeo", "choices": [" wherefore", " why"], "answer": 0},
        {"question": "HAMLET: To be, or not to be, that is the question: whether 'tis nobler in the mind "
                     "to suffer the slings and arrows of outrageous fortune", "choices": [" or", " and"], "answer": 1}]


@pytest.fixture(scope="module", autouse=True)
def own_tasks_only():
    """lm-eval indexes only the task files this module writes, not the 15,000 it ships (some 11 s of CPU): the
    harness calls lm-eval as it always does; which tasks lm-eval ships is lm-eval's concern."""
    import functools

    from lm_eval import tasks

    from zaya.eval.harness import task_manager

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks, "TaskManager", functools.partial(tasks.TaskManager, include_defaults=False))
        yield
    task_manager.cache_clear()


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    """The three tasks' YAML files on a local JSONL of ``DOCS``, and one whose dataset lives on the hub only; one
    directory for the module, so that lm-eval indexes its tasks once (``zaya.eval.harness.task_manager``)."""
    root = tmp_path_factory.mktemp("lm-eval")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, text in TASKS.items():
        (tasks / f"{name}.yaml").write_text(text.format(data=data))
    hub_only = TASKS["zaya_tiny_mc"].replace("zaya_tiny_mc", "zaya_hub_only").replace("dataset_path: json",
                                                                                     "dataset_path: zaya-test/absent")
    (tasks / "zaya_hub_only.yaml").write_text(hub_only.format(data=data))
    return tasks


def test_lm_eval_tasks_on_the_engine(tasks_dir, shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer
    from zaya.eval.harness import ZayaLM, evaluate_tasks

    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")
    model = served_model(vocab_size=512, max_seq_len=64)
    docs = DOCS
    out = evaluate_tasks(model, tok, list(TASKS), include_path=str(tasks_dir), num_slots=4)
    res = out["results"]

    lm = ZayaLM(model, tok, num_slots=2)

    # the same scores from the model's forward pass: a context starts with the tokenizer's prefix (none for zaya's
    # BPE), an empty one is the prefix token (the eos here)
    def logp(context: str, continuation: str) -> float:
        ctx = tok.prefix_ids + tok.encode(context) if context else [lm.prefix_token_id]
        cont = tok.encode(context + continuation)[len(ctx) - len(tok.prefix_ids) if context else 0:]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        return sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))

    acc = sum(max(range(len(d["choices"])), key=lambda i: logp(d["question"], d["choices"][i])) == d["answer"]
              for d in docs) / len(docs)
    assert res["zaya_tiny_mc"]["acc,none"] == pytest.approx(acc)
    assert 0 <= res["zaya_tiny_gen"]["exact_match,none"] <= 1
    assert tok.prefix_ids == [] and lm.prefix_token_id == model.config.eos_token_id

    class Req:
        def __init__(self, *args):
            self.args = args

    pairs = [(d["question"], d["choices"][0]) for d in docs[:2]] + [("", " ROMEO")]  # within the 64-token context
    for (got, _), pair in zip(lm.loglikelihood([Req(*pair) for pair in pairs]), pairs):
        assert got == pytest.approx(logp(*pair), abs=1e-3)
    rolled = lm.loglikelihood_rolling([Req(d["question"]) for d in docs])
    assert rolled[0] == pytest.approx(logp("", docs[0]["question"]), abs=1e-3)  # one window
    words = sum(len(d["question"].split()) for d in docs)
    assert res["zaya_tiny_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(rolled) / words), rel=1e-3)


@pytest.mark.parametrize("task, said", [
    ("zaya_tiny_mcq", ["'zaya_tiny_mcq' is not a task", "did you mean 'zaya_tiny_mc'", "--include-path"]),
    ("zaya_hub_only", ["cannot load task 'zaya_hub_only'", "zaya-test/absent", "--include-path"]),
], ids=["unknown", "not-downloaded"])
def test_a_task_lm_eval_cannot_run_is_a_user_error(tmp_path, capsys, monkeypatch, tasks_dir, shakespeare_dataset,
                                                    task, said):
    import datasets.config

    from zaya.cli import main

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network here either way: fail at once
    checkpoint = served_checkpoint(tmp_path / "ckpt", shakespeare_dataset / "tokenizer.json", max_seq_len=64)
    assert main(["eval", "--checkpoint", str(checkpoint), "--tasks", task, "--include-path", str(tasks_dir),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err  # lm-eval's own notes about the task file may come first
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "a bug" not in err and line.startswith("zaya: error: --tasks: "), err
    for text in said:
        assert text in line, line



def test_local_tasks_are_found_without_indexing_lm_evals_own(tasks_dir, monkeypatch):
    """``--include-path`` tasks are looked up in an index of that directory alone; lm-eval's whole index (some
    15,000 files) is built only for a name the directory does not have."""
    from lm_eval import tasks as lm_tasks

    from zaya.eval import harness

    stubbed = lm_tasks.TaskManager  # the module fixture's: never indexes lm-eval's own tasks, whatever it is asked
    asked = []

    def recording(*args, include_defaults=True, **kwargs):
        asked.append(include_defaults)
        return stubbed(*args, **kwargs)

    monkeypatch.setattr(lm_tasks, "TaskManager", recording)
    harness.task_manager.cache_clear()
    try:
        assert "zaya_tiny_mc" in harness.manager_for(["zaya_tiny_mc"], str(tasks_dir)).all_tasks
        assert asked == [False]
        harness.manager_for(["zaya_not_here"], str(tasks_dir))
        assert asked == [False, True]
    finally:
        harness.task_manager.cache_clear()
