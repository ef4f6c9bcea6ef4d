"""The worked example of docs/finetuning.md: from the tiny model `make train` made to a fine-tuned model served
over the OpenAI API, on a laptop CPU in a few minutes (`make finetune`).

Every step is a command a user could type; each is printed before it runs and timed:

a. export the base run to the Hugging Face layout (``zaya export``);
b. continue pre-training from the export on a handful of plays (``examples/plays_qa.py`` writes their text and the
   question set; ``zaya data prepare --tokenizer`` with the export's tokenizer; ``zaya train --init-from``);
c. fine-tune on chat data, "Which play is this line from?" (``zaya data prepare --format chat``, whose loss masks
   leave only the answers as targets; ``zaya train --init-from`` the continued run), and export the result;
d. held-out accuracy of the base export and of the fine-tuned one (``examples/score_answers.py``: the answer the
   model finds likeliest among the plays' titles; chance is one over their number);
e. serve the fine-tuned export (``zaya serve`` on a free port) and ask it one held-out question through the
   ``openai`` client, then stop the server.

Everything goes under one work directory (default ``runs/finetune-example``); one that holds anything but an
earlier run of this example is refused without ``--force``. The figures land in ``<work>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = "example.json"
"""The file that says a directory is this example's work directory (and so may be replaced)."""
OUTPUTS = ("base-hf", "data", "cpt-data", "cpt", "chat-data", "chat", "chat-hf", "results.json", "serve.log")


def claim_work_dir(work: Path, force: bool, settings: dict) -> None:
    """Make ``work`` this example's, empty of earlier outputs: a directory holding anything but an earlier run of
    the example is refused unless ``force``."""
    if work.exists() and not work.is_dir():
        raise SystemExit(f"--work {work}: exists and is not a directory")
    ours = (work / MARKER).is_file()
    if work.is_dir() and any(work.iterdir()) and not ours and not force:
        raise SystemExit(f"--work {work}: exists and is not this example's work directory (no {MARKER}); choose "
                         "another --work or pass --force to replace the example's outputs in it")
    work.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        path = work / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (work / MARKER).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    """The CPU's model name (as ``lscpu`` shows it), for the record."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def children_cpu_seconds() -> float:
    """User + system CPU time of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Steps:
    """Runs commands as the user would type them (printed first), timing each named step: wall-clock seconds, and
    the CPU seconds its processes used (on a machine shared with other jobs, wall time is mostly waiting)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    def timed(self, step: str, start: float, cpu_start: float) -> None:
        self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - start
        self.cpu_seconds[step] = self.cpu_seconds.get(step, 0.0) + children_cpu_seconds() - cpu_start

    def run(self, step: str, argv: list[str]) -> str:
        """Run ``argv`` (``zaya ...`` or ``python ...``), echoing its output as it comes; returns its stdout."""
        print(f"\n$ {shlex.join(argv)}", flush=True)
        real = self.resolve(argv)
        start, cpu_start = time.perf_counter(), children_cpu_seconds()
        out = []
        with subprocess.Popen(real, stdout=subprocess.PIPE, text=True) as proc:
            for line in proc.stdout:
                print(line, end="", flush=True)
                out.append(line)
        self.timed(step, start, cpu_start)
        if proc.returncode != 0:
            raise SystemExit(f"step {step}: `{shlex.join(argv)}` exited with {proc.returncode}")
        return "".join(out)

    @staticmethod
    def resolve(argv: list[str]) -> list[str]:
        """``zaya`` and ``python`` as this interpreter's (the virtualenv the example runs in)."""
        if argv[0] == "zaya":
            return [sys.executable, "-m", "zaya", *argv[1:]]
        if argv[0] == "python":
            return [sys.executable, *argv[1:]]
        return argv


def commands(base: str, work: Path, seed: int) -> dict[str, list[list[str]]]:
    """The commands of steps a-d, by step (the serving step e is in ``serve_and_ask``)."""
    w = str(work)
    example = os.path.relpath(HERE)
    score = ["python", f"{example}/score_answers.py", "--questions", f"{w}/data/chat-heldout.jsonl", "--json"]
    return {
        "a_export": [["zaya", "export", "--checkpoint", base, "--to", f"{w}/base-hf"]],
        "b_continue": [
            ["python", f"{example}/plays_qa.py", "--out", f"{w}/data", "--seed", str(seed)],
            ["zaya", "data", "prepare", "--tokenizer", f"{w}/base-hf", "--input", f"{w}/data/cpt-text",
             "--out", f"{w}/cpt-data", "--val-fraction", "0.05", "--seed", str(seed)],
            ["zaya", "train", "--config", f"{example}/continue-pretraining.toml", "--init-from", f"{w}/base-hf",
             "--run-dir", f"{w}/cpt", "--set", f'data.datasets={{plays="{w}/cpt-data"}}',
             "--set", f"train.seed={seed}"]],
        "c_finetune": [
            ["zaya", "data", "prepare", "--format", "chat", "--tokenizer", f"{w}/base-hf",
             "--input", f"{w}/data/chat-train.jsonl", "--out", f"{w}/chat-data", "--val-fraction", "0.02",
             "--seed", str(seed)],
            ["zaya", "train", "--config", f"{example}/chat-finetuning.toml", "--init-from", f"{w}/cpt",
             "--run-dir", f"{w}/chat", "--set", f'data.datasets={{chat="{w}/chat-data"}}',
             "--set", f"train.seed={seed}"],
            ["zaya", "export", "--checkpoint", f"{w}/chat", "--to", f"{w}/chat-hf"]],
        "d_accuracy": [[*score, "--checkpoint", f"{w}/base-hf"], [*score, "--checkpoint", f"{w}/chat-hf"]],
    }


def serve_and_ask(work: Path, steps: Steps) -> dict:
    """Step e: ``zaya serve`` the fine-tuned export in the background, ask it one held-out question with the
    ``openai`` client, stop the server."""
    from openai import OpenAI

    row = json.loads((work / "data" / "chat-heldout.jsonl").read_text(encoding="utf-8").splitlines()[0])
    question, answer = row["messages"][0]["content"], row["messages"][-1]["content"]
    port = free_port()
    argv = ["zaya", "serve", "--checkpoint", f"{work}/chat-hf", "--port", str(port), "--max-num-seqs", "2"]
    print(f"\n$ {shlex.join(argv)} &", flush=True)
    start, cpu_start = time.perf_counter(), children_cpu_seconds()
    log = open(work / "serve.log", "w")
    server = subprocess.Popen(steps.resolve(argv), stdout=log, stderr=subprocess.STDOUT)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 120
        while True:  # the server is up once it lists its model
            if server.poll() is not None:
                raise SystemExit(f"zaya serve exited with {server.returncode}; see {work / 'serve.log'}")
            try:
                model = client.models.list().data[0].id
                break
            except Exception:  # noqa: BLE001 - not listening yet
                if time.monotonic() > deadline:
                    raise SystemExit(f"zaya serve did not answer in 120 s; see {work / 'serve.log'}") from None
                time.sleep(0.5)
        print(f">>> client.chat.completions.create(model={model!r}, messages=[{{'role': 'user', "
              f"'content': {question!r}}}], max_tokens=16, temperature=0)")
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                               max_tokens=16, temperature=0)
        said = reply.choices[0].message.content.strip()
        print(f"{said!r}  (the play: {answer!r})", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    steps.timed("e_serve", start, cpu_start)
    return {"question": question, "answer": answer, "reply": said}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="runs/tiny", help="the run to start from (default: the one `make train` "
                                                            "made)")
    parser.add_argument("--work", type=Path, default=Path("runs/finetune-example"), help="work directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="use --work even if it is not this example's")
    parser.add_argument("--print-commands", action="store_true", help="print the commands of steps a-d and exit")
    args = parser.parse_args(argv)
    plan = commands(args.base, args.work, args.seed)
    if args.print_commands:
        for argvs in plan.values():
            for cmd in argvs:
                print(shlex.join(cmd))
        return 0
    if not Path(args.base).is_dir():
        raise SystemExit(f"--base {args.base}: no such run; train it first (`make train`)")
    claim_work_dir(args.work, args.force, {"example": "examples/finetune.py", "base": args.base, "seed": args.seed})
    steps = Steps()
    outputs = {name: [steps.run(name, cmd) for cmd in argvs] for name, argvs in plan.items()}
    before, after = (json.loads(out.strip().splitlines()[-1]) for out in outputs["d_accuracy"])
    chat = serve_and_ask(args.work, steps)
    results = {"machine": cpu_name(), "cpus": os.cpu_count(), "seed": args.seed, "before": before, "after": after,
               "chat": chat, "seconds": {k: round(v, 1) for k, v in steps.seconds.items()},
               "cpu_seconds": {k: round(v, 1) for k, v in steps.cpu_seconds.items()},
               "total_seconds": round(sum(steps.seconds.values()), 1),
               "total_cpu_seconds": round(sum(steps.cpu_seconds.values()), 1), "load_average": os.getloadavg()}
    (args.work / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"\nheld-out accuracy over {before['questions']} questions ({before['candidates']} plays, chance "
          f"{before['chance']:.0%}): base {before['accuracy']:.1%}, fine-tuned {after['accuracy']:.1%}; greedy "
          f"exact match {before['greedy_exact']:.1%} -> {after['greedy_exact']:.1%}")
    print("seconds (wall / CPU): " + ", ".join(f"{k} {v:.0f} / {steps.cpu_seconds[k]:.0f}"
                                               for k, v in steps.seconds.items())
          + f"; total {results['total_seconds']:.0f} / {results['total_cpu_seconds']:.0f} on {results['machine']} "
          f"({results['cpus']} CPUs, load average {results['load_average'][0]:.1f} at the end)")
    print(f"wrote {args.work / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
