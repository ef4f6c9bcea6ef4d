"""``zaya eval --tasks``: lm-evaluation-harness on the engine, on task files and data the test writes (no
downloads): a multiple-choice (loglikelihood), a generation (generate_until) and a perplexity
(loglikelihood_rolling) task; the scores are checked against the model's own forward."""

from __future__ import annotations

import json
import math

import pytest
import torch

from serve_helpers import served_model

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


def test_lm_eval_tasks_on_the_engine(tmp_path, shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer
    from zaya.eval.harness import ZayaLM, evaluate_tasks

    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")
    model = served_model(vocab_size=512, max_seq_len=64)
    docs = [{"question": "ROMEO: What light", "choices": [" breaks", " sings", " falls"], "answer": 0},
            {"question": "JULIET: O Romeo, Romeo", "choices": [" wherefore", " why"], "answer": 0},
            {"question": "HAMLET: To be, or not to be, that is the question: whether 'tis nobler in the mind "
                         "to suffer the slings and arrows of outrageous fortune", "choices": [" or", " and"],
             "answer": 1}]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    for name, text in TASKS.items():
        (tasks_dir / f"{name}.yaml").write_text(text.format(data=data))
    out = evaluate_tasks(model, tok, list(TASKS), include_path=str(tasks_dir), num_slots=4)
    res = out["results"]

    # the same scores from the model's forward pass
    def logp(context: str, continuation: str) -> float:
        ctx = [2] + tok.encode(context)
        cont = tok.encode(context + continuation)[len(ctx) - 1:]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        return sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))

    acc = sum(max(range(len(d["choices"])), key=lambda i: logp(d["question"], d["choices"][i])) == d["answer"]
              for d in docs) / len(docs)
    assert res["zaya_tiny_mc"]["acc,none"] == pytest.approx(acc)
    assert 0 <= res["zaya_tiny_gen"]["exact_match,none"] <= 1
    lm = ZayaLM(model, tok, num_slots=2)

    class Req:
        def __init__(self, *args):
            self.args = args

    rolled = lm.loglikelihood_rolling([Req(d["question"]) for d in docs])
    assert rolled[0] == pytest.approx(logp("", docs[0]["question"]), abs=1e-3)  # one window
    words = sum(len(d["question"].split()) for d in docs)
    assert res["zaya_tiny_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(rolled) / words), rel=1e-3)
