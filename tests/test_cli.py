"""The `zaya` command: error reporting, `info`, and an end-to-end `train` on a micro config."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zaya.cli import main

ROOT = Path(__file__).resolve().parents[1]

MICRO = """
[model]
vocab_size = 512
eos_token_id = 2
hidden_size = 64
num_layers = 2
num_query_heads = 2
num_kv_heads = 2
head_dim = 32
num_experts = 4
expert_hidden_size = 128
router_hidden_size = 32
max_seq_len = 64

[data]
datasets = { shakespeare = "DATASET" }

[train]
steps = 30
batch_size = 4
seq_len = 32
warmup_steps = 5
log_every = 10
sample_tokens = 20
"""


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


@pytest.fixture
def micro(shakespeare_dataset):
    return MICRO.replace("DATASET", str(shakespeare_dataset))


def test_trainer_refuses_a_model_vocab_that_does_not_match_the_data(tmp_path, capsys, micro):
    cfg = write(tmp_path / "small_vocab.toml", micro.replace("vocab_size = 512", "vocab_size = 384"))
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size" in err and "512" in err and "384" in err


def test_trainer_refuses_a_missing_dataset(tmp_path, capsys, micro):
    cfg = write(tmp_path / "nodata.toml", micro.replace(str(Path(micro.split('"')[1])), str(tmp_path / "nope")))
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "zaya data prepare" in err


def test_bad_argument_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--to", "onnx", "--src", "a", "--dst", "b"])
    assert exc.value.code == 2


def test_info_zaya1_base_json():
    out = subprocess.run([sys.executable, "-m", "zaya", "info", "--config", str(ROOT / "configs/zaya1-base.toml"),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    info = json.loads(lines[0])
    assert info["params_total"] == 8_840_488_784
    assert info["params_embedding"] == 537_133_056


def test_train_end_to_end_micro(tmp_path, capsys, micro):
    cfg = write(tmp_path / "micro.toml", micro)
    out_dir = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--steps", "30", "--out", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert "step    30/30" in printed and "ROMEO:" in printed
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["steps"] == 30
    assert metrics["final_loss"] < metrics["first_loss"] - 0.5  # 30 steps: ln(512)=6.24 down past 5.74
    assert metrics["val_loss"] < metrics["first_loss"]
    assert metrics["tokens_per_s"] > 0
    from zaya.config import load_config

    assert load_config(out_dir / "config.toml").train.steps == 30  # the run records what it used
    checkpoint = out_dir / "model"
    assert metrics["checkpoint"] == str(checkpoint)
    assert (checkpoint / "zaya.json").is_file() and (checkpoint / "model.safetensors").is_file()

    import zaya

    model = zaya.load_pretrained(checkpoint)
    assert model.config.hidden_size == 64

    # a second run into the same directory replaces the previous run
    assert main(["train", "--config", str(cfg), "--steps", "1", "--out", str(out_dir)]) == 0
    assert json.loads((out_dir / "metrics.json").read_text())["steps"] == 1


def test_train_refuses_to_replace_an_unrelated_directory(tmp_path, capsys, micro):
    cfg = write(tmp_path / "micro.toml", micro)
    other = tmp_path / "precious" / "model"
    other.mkdir(parents=True)
    (other / "notes.txt").write_text("keep me")
    assert main(["train", "--config", str(cfg), "--steps", "1", "--out", str(other.parent)]) == 2
    assert "precious" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep me"
