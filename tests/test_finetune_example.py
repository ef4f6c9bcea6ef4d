"""The worked example's pieces (examples/, docs/finetuning.md) at the smallest size: the question set and its
position split, the answer scorer on a tiny model, the work directory's guard, and that every command the example
runs parses as the CLI and configs read it. The whole example (minutes) is `make finetune`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from model_helpers import tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import finetune  # noqa: E402
import plays_qa  # noqa: E402
import score_answers  # noqa: E402


@pytest.fixture(scope="module")
def question_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plays-qa")
    plays = plays_qa.load_plays(["macbeth", "othello"], heldout_fraction=0.2)
    plays_qa.build(out, plays, heldout_per_play=5, seed=0)
    return out


def _rows(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_split_is_by_position_and_holds_the_fraction():
    play = plays_qa.load_plays(["macbeth"], heldout_fraction=0.2)[0]
    scenes = plays_qa.clean_play_markdown(next(p for p in plays_qa.corpus_files() if p.stem == "macbeth")
                                          .read_text(encoding="utf-8"))
    assert play.title == "Macbeth"
    assert play.train_scenes + play.heldout_scenes == scenes  # in order: a prefix and the rest
    held = sum(len(plays_qa.speeches(s)) for s in play.heldout_scenes)
    total = sum(len(plays_qa.speeches(s)) for s in scenes)
    assert 0.2 * total <= held < 0.2 * total + len(plays_qa.speeches(play.heldout_scenes[0]))


def test_no_held_out_line_is_in_the_training_text_or_chat_set(question_set):
    heldout = _rows(question_set / "chat-heldout.jsonl")
    train = _rows(question_set / "chat-train.jsonl")
    text = "\n".join(p.read_text(encoding="utf-8") for p in (question_set / "cpt-text").iterdir())
    train_questions = {m[0]["content"] for m in train}
    assert len(heldout) == 10 and len(train) > 100
    for messages in heldout:
        line = messages[0]["content"].split("\n\n", 1)[1].split(": ", 1)[1]
        assert messages[0]["content"] not in train_questions
        assert line not in text
    answers = [m[-1]["content"] for m in heldout]
    assert answers.count("Macbeth") == answers.count("Othello") == 5  # balanced: a constant answer scores chance
    summary = json.loads((question_set / "questions.json").read_text())
    assert summary["candidates"] == ["Macbeth", "Othello"] and summary["chance"] == 0.5


def test_scores_are_the_models_log_likelihood_of_the_marked_tokens_whatever_the_padding():
    model = tiny_model().eval()
    sequences = [([5, 9, 11, 3], [False, False, True, True]), ([5, 9, 11, 3, 7, 8, 2], [False] * 4 + [True] * 3)]
    batched = score_answers.score_sequences(model, sequences, pad_id=0)
    for (ids, targets), (total, greedy) in zip(sequences, batched):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1)
        marked = [t for t in range(1, len(ids)) if targets[t]]
        assert total == pytest.approx(sum(float(logp[t - 1, ids[t]]) for t in marked), abs=1e-4)
        assert greedy == all(int(logits[t - 1].argmax()) == ids[t] for t in marked)
    alone = score_answers.score_sequences(model, sequences[:1], pad_id=0)[0]
    assert batched[0][0] == pytest.approx(alone[0], abs=1e-4) and batched[0][1] == alone[1]


class _Prefers(torch.nn.Module):
    """A model that always finds token ``favourite`` likeliest next, whatever came before."""

    def __init__(self, favourite: int, vocab: int = 16):
        super().__init__()
        self.favourite, self.vocab = favourite, vocab

    def forward(self, ids, attention_mask=None):
        logits = torch.zeros(*ids.shape, self.vocab)
        logits[..., self.favourite] = 5.0
        return type("Out", (), {"logits": logits})()


def test_evaluate_picks_the_likeliest_candidate_and_states_chance():
    answers = ["a", "b", "c", "a", "b", "c"]
    questions = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": a}]
                 for i, a in enumerate(answers)]
    ids = {"a": 3, "b": 4, "c": 5}

    def encode(messages):  # the prompt as one token, the reply as its letter's token
        return [1, ids[messages[-1]["content"]]], [False, True]

    result = score_answers.evaluate(_Prefers(favourite=4), encode, questions, pad_id=0)
    assert result["candidates"] == 3 and result["chance"] == pytest.approx(1 / 3)
    assert result["accuracy"] == pytest.approx(2 / 6) and result["greedy_exact"] == pytest.approx(2 / 6)
    assert result["by_answer"] == {"a": "0/2", "b": "2/2", "c": "0/2"}


def test_the_work_directory_of_something_else_is_refused_without_force(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit, match="not this example's work directory"):
        finetune.claim_work_dir(tmp_path, force=False, settings={})
    finetune.claim_work_dir(tmp_path, force=True, settings={"seed": 0})
    assert (tmp_path / "mine.txt").read_text() == "keep"  # --force replaces the example's outputs only
    (tmp_path / "chat").mkdir()
    finetune.claim_work_dir(tmp_path, force=False, settings={"seed": 0})  # its own: replaced
    assert not (tmp_path / "chat").exists()


def test_every_command_parses_and_its_config_loads(tmp_path):
    from zaya.cli import _train_overrides, build_parser
    from zaya.config import load_config

    plan = finetune.commands("runs/tiny", tmp_path / "work", seed=0)
    parser = build_parser()
    ran = 0
    for argvs in plan.values():
        for argv in argvs:
            if argv[0] == "python":
                script = {"plays_qa.py": plays_qa, "score_answers.py": score_answers}[Path(argv[1]).name]
                script.parser().parse_args(argv[2:])
            else:
                args = parser.parse_args(argv[1:])
                if args.verb == "train":
                    load_config(args.config, _train_overrides(args))
            ran += 1
    assert ran == 9



def test_the_scorer_encodes_a_conversation_as_chat_data_prepare_writes_it(question_set, tmp_path):
    from zaya.data.bundle import PreparedDataset
    from zaya.data.prepare import PrepareOptions, prepare
    from zaya.data.tokenizer import Tokenizer

    texts = [p.read_text(encoding="utf-8") for p in sorted((question_set / "cpt-text").iterdir())]
    (tmp_path / "tok").mkdir()
    Tokenizer.train(texts, vocab_size=320).save(tmp_path / "tok" / "tokenizer.json")
    chats = tmp_path / "chats.jsonl"
    lines = (question_set / "chat-train.jsonl").read_text(encoding="utf-8").splitlines()[:6]
    chats.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepare(PrepareOptions(inputs=[str(chats)], out=str(tmp_path / "data"), tokenizer=str(tmp_path / "tok"),
                           format="chat", val_fraction=0.0), log=lambda m: None)
    bundle = PreparedDataset(tmp_path / "data").splits["train"].bundles[0]
    encode = score_answers.ChatEncoder(tmp_path / "tok" / "tokenizer.json")
    try:
        for i, line in enumerate(lines):
            ids, targets = encode(json.loads(line)["messages"])
            start, end = int(bundle.index[i]), int(bundle.index[i + 1])
            assert ids == bundle.document(i).tolist()
            assert targets == [bool(m) for m in bundle.mask[start:end]]
            assert targets[-1] and not targets[0]  # the reply's end (eos) is a target, the question is not
    finally:
        encode.close()
