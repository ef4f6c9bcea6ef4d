"""The worked example's data: "Which play is this line from?" over a handful of the built-in corpus's plays.

Each play (read as zaya reads the corpus: ``zaya.data.sources.clean_play_markdown``, one document per scene) is
split by position: its last scenes, holding at least ``heldout_fraction`` of its speeches, are held out; the scenes
before them are the training part. From the training part come

- ``cpt-text/``: those scenes as plain-text files, one document each (the text for continued pre-training), and
- ``chat-train.jsonl``: one chat example per speech, ``{"messages": [user, assistant]}``, the user asking which of
  the plays the speech's first line (with its speaker, as the text prints it) is from, the assistant answering
  with the play's title;

from the held-out part, ``chat-heldout.jsonl``: the same questions, the same number from each play (so a model that
always gives one answer scores exactly chance, 1 / number of plays). No held-out scene's text is in the other two
files. ``questions.json`` records the plays, titles, counts and the rule.

Run as a script: ``python examples/plays_qa.py --out DIR`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from zaya.data.corpus import corpus_files
from zaya.data.sources import clean_play_markdown

DEFAULT_PLAYS = ("hamlet", "king-lear", "macbeth", "othello", "romeo-and-juliet")
SPEAKER = re.compile(r"^([A-Za-z][A-Za-z .'-]*):$")
MIN_WORDS = 4
"""A speech is asked about when its first line has at least this many words ("Ay, my lord." names no play)."""


@dataclass(frozen=True)
class Speech:
    speaker: str
    line: str


def speeches(scene: str) -> list[Speech]:
    """The speeches of one scene document, each as its speaker and its first line of text (stage directions,
    ``[...]``, skipped); speeches whose first line is shorter than ``MIN_WORDS`` words are left out."""
    found: list[Speech] = []
    lines = scene.splitlines()
    for i, raw in enumerate(lines):
        match = SPEAKER.match(raw.strip())
        if match is None or (i > 0 and lines[i - 1].strip()):
            continue
        first = next((l.strip() for l in lines[i + 1:] if l.strip() and not l.strip().startswith("[")), "")
        if len(first.split()) >= MIN_WORDS and not SPEAKER.match(first):
            found.append(Speech(match.group(1), first))
    return found


@dataclass(frozen=True)
class Play:
    name: str
    title: str
    train_scenes: list[str]
    heldout_scenes: list[str]


def split_play(name: str, markdown: str, heldout_fraction: float) -> Play:
    """A play's scenes split by position: the last scenes, holding at least ``heldout_fraction`` of its speeches,
    are held out (at least one scene on each side)."""
    scenes = clean_play_markdown(markdown)
    if len(scenes) < 2:
        raise ValueError(f"{name}: {len(scenes)} scene(s); a play needs two to be split")
    title = scenes[0].splitlines()[0].strip()
    counts = [len(speeches(s)) for s in scenes]
    cut, held = len(scenes), 0
    while cut > 1 and held < heldout_fraction * sum(counts):
        cut -= 1
        held += counts[cut]
    return Play(name, title, scenes[:cut], scenes[cut:])


def load_plays(names: list[str], heldout_fraction: float) -> list[Play]:
    """The named plays (file stems of the corpus, e.g. ``macbeth``), split; an unknown name is an error listing
    the known ones."""
    files = {path.stem: path for path in corpus_files()}
    unknown = [n for n in names if n not in files]
    if unknown:
        raise SystemExit(f"unknown play(s) {', '.join(unknown)}; the corpus has: {', '.join(sorted(files))}")
    return [split_play(n, files[n].read_text(encoding="utf-8"), heldout_fraction) for n in names]


def question(speech: Speech, titles: list[str]) -> str:
    options = ", ".join(titles[:-1]) + f" or {titles[-1]}"
    return f"Which play is this line from: {options}?\n\n{speech.speaker}: {speech.line}"


def chat_example(speech: Speech, titles: list[str], answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question(speech, titles)},
                         {"role": "assistant", "content": answer}]}


def build(out: Path, plays: list[Play], heldout_per_play: int, seed: int) -> dict:
    """Write ``cpt-text/``, ``chat-train.jsonl``, ``chat-heldout.jsonl`` and ``questions.json`` under ``out``;
    returns what ``questions.json`` holds."""
    rng = random.Random(seed)
    titles = [p.title for p in plays]
    text_dir = out / "cpt-text"
    text_dir.mkdir(parents=True, exist_ok=True)
    train, heldout, counts = [], [], {}
    for play in plays:
        for i, scene in enumerate(play.train_scenes):
            (text_dir / f"{play.name}-{i:03d}.txt").write_text(scene, encoding="utf-8")
        mine = [chat_example(s, titles, play.title) for scene in play.train_scenes for s in speeches(scene)]
        pool = [chat_example(s, titles, play.title) for scene in play.heldout_scenes for s in speeches(scene)]
        if len(pool) < heldout_per_play:
            raise SystemExit(f"{play.name}: {len(pool)} held-out speeches, fewer than --heldout-per-play "
                             f"{heldout_per_play}")
        chosen = rng.sample(pool, heldout_per_play)
        train += mine
        heldout += chosen
        counts[play.title] = {"train_scenes": len(play.train_scenes), "heldout_scenes": len(play.heldout_scenes),
                              "train_questions": len(mine), "heldout_questions": len(chosen)}
    rng.shuffle(train)
    for name, rows in (("chat-train.jsonl", train), ("chat-heldout.jsonl", heldout)):
        with open(out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    summary = {"question": "Which play is this line from?", "candidates": titles,
               "chance": 1 / len(titles), "seed": seed, "plays": counts,
               "split": "by position: each play's last scenes (at least the held-out fraction of its speeches) are "
                        "held out; their text is in neither cpt-text/ nor chat-train.jsonl"}
    (out / "questions.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write")
    parser.add_argument("--plays", default=",".join(DEFAULT_PLAYS), help="corpus file stems, comma-separated")
    parser.add_argument("--heldout-fraction", type=float, default=0.2, help="share of speeches held out per play")
    parser.add_argument("--heldout-per-play", type=int, default=40, help="held-out questions per play")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    plays = load_plays([p for p in args.plays.split(",") if p], args.heldout_fraction)
    summary = build(args.out, plays, args.heldout_per_play, args.seed)
    for title, c in summary["plays"].items():
        print(f"{title}: {c['train_questions']} training questions from {c['train_scenes']} scenes, "
              f"{c['heldout_questions']} held-out from {c['heldout_scenes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
