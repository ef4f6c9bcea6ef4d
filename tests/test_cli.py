"""The `zaya` command: error reporting, `info`, and an end-to-end `train` on a micro config."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zaya.cli import main

ROOT = Path(__file__).resolve().parents[1]

def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_unknown_config_key_is_one_line_error_with_suggestion(tmp_path, capsys):
    cfg = write(tmp_path / "bad.toml", "[model]\nhiden_size = 64\n")
    assert main(["info", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zaya: error: ")
    assert "hidden_size" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err


def test_trainer_refuses_a_model_vocab_that_does_not_match_the_data(tmp_path, capsys, micro_config):
    cfg = micro_config()
    assert main(["train", "--config", str(cfg), "--set", "model.vocab_size=384"]) == 3  # a data error
    err = capsys.readouterr().err
    assert "model.vocab_size" in err and "512" in err and "384" in err


def test_trainer_refuses_a_missing_dataset(tmp_path, capsys, micro_config):
    cfg = micro_config()
    assert main(["train", "--config", str(cfg), "--set", f'data.datasets.shakespeare="{tmp_path / "nope"}"']) == 3
    err = capsys.readouterr().err
    assert "nope" in err and "zaya data prepare" in err


def test_bad_argument_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--to", "onnx", "--src", "a", "--dst", "b"])
    assert exc.value.code == 2


def test_commands_that_need_no_torch_start_without_importing_it():
    """Building the parser for `zaya run` (the supervisor), `chaos inject` or `aegis report` imports no torch (it
    took about 2 s of every command's start-up); the full parser, and `plan`'s and `tune cost`'s own, still
    declare their options."""
    code = ("import sys\n"
            "from zaya.cli import build_parser\n"
            "for argv in (['run', '--config', 'c.toml'], ['chaos', 'inject', 'r', 'kill'], ['aegis', 'report', 'r']):\n"
            "    build_parser(argv).parse_args(argv)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
    from zaya.cli import build_parser

    plan = ["plan", "--config", "c.toml", "--gpus", "8", "--gpu-memory", "80", "--tflops", "989"]
    for parser in (build_parser(), build_parser(plan)):
        assert parser.parse_args(plan).gpus == 8
    assert build_parser(["tune", "cost", "--config", "c"]).parse_args(["tune", "cost", "--config", "c"]).top == 5


def test_info_zaya1_base_json(capsys):
    """In this process (a `zaya` subprocess would add 10-30 s of torch and dynamo start-up on 2 busy cores): stdout
    is the JSON line alone."""
    assert main(["info", "--config", str(ROOT / "configs/zaya1-base.toml"), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    info = json.loads(lines[0])
    assert info["params_total"] == 8_840_488_784
    assert info["params_embedding"] == 537_133_056


@pytest.mark.plots
def test_train_end_to_end_micro(tmp_path, capsys, micro_config):
    run = tmp_path / "run"
    cfg = micro_config(run)
    assert main(["train", "--config", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "step      6/6" in printed and "ROMEO:" in printed and "validation loss" in printed
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mfu", "expert_load",
                "expert_load_max_over_mean", "skip_fraction", "stage", "seq_len", "global_batch_tokens"):
        assert key in train[-1], key
    assert train[-1]["tokens"] == 6 * 4 * 32
    assert len(train[-1]["expert_load"]) == 2 and len(train[-1]["expert_load"][0]) == 5  # 4 experts + skip
    assert [r["step"] for r in records if r["kind"] == "val"] == [0, 3, 6]
    from zaya.config import load_config

    assert load_config(run / "config.toml").train.max_steps == 6  # the run records what it used
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == ["step-00000003", "step-00000006"]
    assert (run / "checkpoints" / "step-00000006" / "COMMIT").is_file()
    assert {p.name for p in (run / "plots").iterdir()} >= {"loss.png", "lr.png", "throughput.png",
                                                              "expert_load.png"}

    # generate and eval accept the run directory, a checkpoint directory
    assert main(["generate", "--checkpoint", str(run), "--prompt", "JULIET:", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("JULIET:")
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "step-00000003"), "--data",
                 str(Path(str(cfg)).parent), "--json"]) == 3  # not a dataset: a data error
    capsys.readouterr()


def test_train_refuses_a_run_dir_of_another_config_and_never_moves_it_aside(tmp_path, capsys, micro_config):
    run = tmp_path / "run"
    cfg = micro_config(run)
    assert main(["train", "--config", str(cfg), "--max-steps", "1", "--set", "optim.schedule_steps=6"]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(cfg), "--set", "optim.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr" in err and "--resume never" in err
    assert main(["train", "--config", str(cfg), "--max-steps", "1", "--set", "optim.lr=1e-3",
                 "--resume", "never"]) == 0
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(moved) == 1 and (moved[0] / "checkpoints" / "step-00000001" / "COMMIT").is_file()


def test_train_refuses_an_unrelated_directory(tmp_path, capsys, micro_config):
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main(["train", "--config", str(micro_config(other)), "--max-steps", "1"]) == 2
    assert "precious" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep me"


def test_eval_keeps_to_the_models_context_and_generate_needs_a_prompt(capsys, micro_run, shakespeare_dataset):
    """The micro run's model has a 64-token context: ``--seq-len`` past it is refused naming both numbers and the
    fix, and the default is the context; its BPE puts nothing before a text, so an empty prompt is refused."""
    base = ["eval", "--checkpoint", str(micro_run), "--data", str(shakespeare_dataset), "--batch-size", "2",
            "--max-batches", "1", "--json"]
    assert main([*base, "--seq-len", "65"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zaya: error: --seq-len 65 ") and "(64 tokens" in err and "--seq-len 64 or less" in err
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 64
    assert main(["generate", "--checkpoint", str(micro_run), "--max-new-tokens", "2"]) == 2
    assert "--prompt is empty" in capsys.readouterr().err
