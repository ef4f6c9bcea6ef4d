"""Held-out accuracy of a model on chat questions with a fixed set of answers (the worked example's step d).

For each question (a ``{"messages": [..., assistant]}`` line, the last message the right answer), every candidate
answer (the distinct answers of the file) is put in the assistant's place and the conversation is encoded exactly as
``zaya data prepare --format chat`` encodes training examples (same template, same tokens, same loss mask). The
model's log-likelihood of a candidate is the sum of the log-probabilities of its masked tokens (the reply and its
end-of-turn text) given what precedes them; the likeliest candidate is the model's answer. Chance is one over the
number of candidates.

Greedy exact match: whether greedy decoding from the prompt writes the right reply token for token, read off the
same forward pass (at every masked position the most likely token is the right one: with teacher forcing, each
step's prefix is then exactly what greedy decoding would have written).

Run as a script: ``python examples/score_answers.py --checkpoint PATH --questions FILE`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch


def read_questions(path: Path) -> list[list[dict]]:
    """The conversations of a JSONL file, each ending with the assistant's (right) answer."""
    rows = [json.loads(line)["messages"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, messages in enumerate(rows):
        if not messages or messages[-1]["role"] != "assistant":
            raise SystemExit(f"{path}: line {i + 1} does not end with an assistant message (the right answer)")
    return rows


@torch.no_grad()
def score_sequences(model, sequences: list[tuple[list[int], list[bool]]], pad_id: int) -> list[tuple[float, bool]]:
    """For each ``(ids, targets)`` (``targets[t]``: token ``t`` is scored, predicted from the tokens before it):
    the summed log-probability of the scored tokens and whether each is also the most likely token there. One
    right-padded batch (padding after a sequence does not change a causal model's outputs on it)."""
    length = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    scored = torch.zeros((len(sequences), length), dtype=torch.bool)
    for row, (seq, targets) in enumerate(sequences):
        ids[row, :len(seq)] = torch.tensor(seq)
        scored[row, :len(seq)] = torch.tensor(targets, dtype=torch.bool)
    attention = (torch.arange(length)[None, :] < torch.tensor([len(s) for s, _ in sequences])[:, None]).long()
    logits = model(ids, attention_mask=attention).logits.float()[:, :-1]
    logp = torch.log_softmax(logits, dim=-1)
    target, mask = ids[:, 1:], scored[:, 1:]
    token_logp = logp.gather(-1, target[..., None])[..., 0]
    best = logits.argmax(-1) == target
    sums = (token_logp * mask).sum(-1)
    greedy = (best | ~mask).all(-1)
    return [(float(s), bool(g)) for s, g in zip(sums, greedy)]


def evaluate(model, encode, questions: list[list[dict]], pad_id: int) -> dict:
    """Accuracy (likeliest candidate) and greedy exact match over ``questions``; ``encode(messages) -> (ids,
    targets)`` is the training data's encoding."""
    candidates = sorted({q[-1]["content"] for q in questions})
    right, greedy = 0, 0
    by_answer: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for messages in questions:
        answer = messages[-1]["content"]
        scores = score_sequences(model, [encode([*messages[:-1], {"role": "assistant", "content": c}])
                                         for c in candidates], pad_id)
        pick = max(range(len(candidates)), key=lambda i: scores[i][0])
        hit = candidates[pick] == answer
        right += hit
        greedy += scores[candidates.index(answer)][1]
        by_answer[answer][0] += hit
        by_answer[answer][1] += 1
    n = len(questions)
    return {"questions": n, "candidates": len(candidates), "chance": 1 / len(candidates), "accuracy": right / n,
            "greedy_exact": greedy / n, "by_answer": {a: f"{r}/{t}" for a, (r, t) in sorted(by_answer.items())}}


class ChatEncoder:
    """``encoder(messages) -> (ids, targets)``: a conversation as ``zaya data prepare --format chat`` writes it, with
    the tokenizer's chat template or zaya's default: ``prefix_ids``, the rendered text, then the document's eos,
    which is a target after a reply (the model learned to stop there)."""

    def __init__(self, tokenizer_path: str | Path) -> None:
        from zaya.data.chat_template import ConversationRenderer
        from zaya.data.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.renderer = ConversationRenderer(self.tokenizer)

    def __call__(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        from zaya.data.chat_template import conversation_ids

        rendered = self.renderer.conversation(messages)
        ids, mask = conversation_ids(self.tokenizer, rendered.text, rendered.targets, self.renderer.special_tokens)
        return [*ids, self.tokenizer.special.eos], [*map(bool, mask), bool(mask[-1])]

    def close(self) -> None:
        self.renderer.close()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="an export, run or checkpoint (as `zaya eval` takes)")
    parser.add_argument("--questions", required=True, type=Path, help="JSONL of {\"messages\": [...]} lines")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    return parser


def main(argv: list[str] | None = None) -> int:
    from zaya.checkpoint.consolidate import load_for_inference

    args = parser().parse_args(argv)
    questions = read_questions(args.questions)
    model, tokenizer_path, directory = load_for_inference(args.checkpoint, dtype=torch.float32)
    if tokenizer_path is None:
        raise SystemExit(f"{directory}: no tokenizer.json beside it; score an export or a run (they carry theirs)")
    encode = ChatEncoder(tokenizer_path)
    try:
        result = {"checkpoint": str(directory), **evaluate(model, encode, questions, encode.tokenizer.special.pad)}
    finally:
        encode.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{directory}: {result['accuracy']:.1%} of {result['questions']} held-out questions right (chance "
              f"{result['chance']:.1%} over {result['candidates']} answers), greedy exact match "
              f"{result['greedy_exact']:.1%}; by answer {result['by_answer']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
