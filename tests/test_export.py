"""`zaya export`: one consolidated, inference-ready copy of a training run, bit-exact in both layouts, written
atomically; the refusals (existing destination, incomplete checkpoint, missing source, unknown format) are one-line
errors that write nothing. The session's micro run (2 steps) is what they export."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MICRO_RUN_STEPS as STEPS
from zaya.checkpoint.consolidate import load_for_inference
from zaya.checkpoint.export import export
from zaya.cli import main
from zaya.model.hf import load_hf
from zaya.model.load import load_directory as load_pretrained


@pytest.fixture(scope="module")
def run(micro_run) -> Path:
    return micro_run


@pytest.fixture(scope="module")
def trained(run) -> torch.nn.Module:
    """The run's model as ``zaya generate`` loads it (DCP reassembled in this process)."""
    return load_for_inference(run)[0]


def step_dir(run: Path) -> Path:
    return run / "checkpoints" / f"step-{STEPS:08d}"


def assert_same_tensors(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name  # bit-exact, not close


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith("zaya: error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or p.name.endswith(".old")]


@pytest.mark.parametrize("args, files, load", [
    ([], {"config.json", "model.safetensors", "zaya_extras.safetensors", "generation_config.json",  # default: hf
          "tokenizer_config.json", "special_tokens_map.json"}, load_hf),
    (["--format", "safetensors"], {"zaya.json", "model.safetensors"}, load_pretrained),
], ids=["hf", "safetensors"])
def test_export_of_a_run_is_bit_exact(tmp_path, capsys, run, trained, args, files, load):
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(run), "--to", str(out), *args]) == 0
    assert {p.name for p in out.iterdir()} == files | {"tokenizer.json", "SHA256SUMS"}
    assert (out / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert_same_tensors(load(out), trained)
    assert leftovers(tmp_path) == []

    printed = capsys.readouterr().out
    params = sum(p.numel() for p in trained.parameters())
    assert printed.count("\n") == 1 and str(out) in printed
    fmt = "hf" if not args else "safetensors"
    assert f": {fmt} (" in printed and f"{params:,} parameters" in printed and "float32" in printed
    assert str(step_dir(run)) in printed and f"(step {STEPS}," in printed


def test_generate_and_eval_accept_the_export(tmp_path, capsys, run, shakespeare_dataset):
    out = tmp_path / "hf"
    assert export(run, out) == out
    assert main(["generate", "--checkpoint", str(out), "--prompt", "JULIET:", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("JULIET:")  # its tokenizer.json was found in the export

    losses = []
    for checkpoint in (run, out):
        assert main(["eval", "--checkpoint", str(checkpoint), "--data", str(shakespeare_dataset), "--seq-len", "32",
                     "--batch-size", "2", "--max-batches", "2", "--dtype", "float32", "--json"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["loss"])
    assert losses[0] == losses[1]


def test_bfloat16_export_keeps_the_balancing_state_fp32(tmp_path, capsys, run, trained):
    out = tmp_path / "bf16"
    assert main(["export", "--checkpoint", str(step_dir(run)), "--to", str(out), "--format", "safetensors",
                 "--dtype", "bfloat16"]) == 0
    assert "bfloat16" in capsys.readouterr().out
    got = load_pretrained(out).state_dict()
    for name, tensor in trained.state_dict().items():
        if ".router.balanc" in name or not tensor.is_floating_point():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        else:
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor.bfloat16()), name


def test_existing_destination_is_refused_without_force(tmp_path, capsys, run, trained):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["export", "--checkpoint", str(run), "--to", str(out)]) == 2
    err = one_line_error(capsys)
    assert str(out) in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"

    assert main(["export", "--checkpoint", str(run), "--to", str(out), "--force"]) == 0
    assert not (out / "notes.txt").exists()
    assert_same_tensors(load_hf(out), trained)
    assert leftovers(tmp_path) == []

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", "--checkpoint", str(run), "--to", str(empty)]) == 0  # an empty directory is used as is
    assert (empty / "config.json").is_file()


def test_destination_that_holds_the_source_is_refused_even_with_force(tmp_path, capsys, run):
    before = sorted(p.name for p in run.iterdir())
    for to in (run, step_dir(run)):
        assert main(["export", "--checkpoint", str(step_dir(run)), "--to", str(to), "--force"]) == 2
        assert "source" in one_line_error(capsys)
    assert sorted(p.name for p in run.iterdir()) == before and (step_dir(run) / "COMMIT").is_file()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError], ids=["ctrl-c", "disk-full"])
def test_an_interrupted_export_leaves_no_directory_and_keeps_the_old_one(tmp_path, capsys, monkeypatch, run,
                                                                         interrupt):
    import zaya.model.hf as zhf

    real_save = zhf.save_safetensors

    def failing_save(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)  # one file written: fail half way through the export
        raise interrupt("injected")

    out = tmp_path / "out"
    monkeypatch.setattr(zhf, "save_safetensors", failing_save)
    with pytest.raises(interrupt):
        export(run, out)
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setattr(zhf, "save_safetensors", real_save)
    export(run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(zhf, "save_safetensors", failing_save)
    if interrupt is KeyboardInterrupt:  # the CLI: exit 130, the old export untouched
        assert main(["export", "--checkpoint", str(run), "--to", str(out), "--force"]) == 130
        assert "interrupted" in capsys.readouterr().err
    else:
        with pytest.raises(OSError, match="injected"):
            export(run, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_incomplete_checkpoint_is_refused(tmp_path, capsys, run):
    partial = tmp_path / "step-partial"
    shutil.copytree(step_dir(run), partial)
    (partial / "COMMIT").unlink()  # a save that died before its marker
    lone_run = tmp_path / "lone-run"
    shutil.copytree(partial, lone_run / "checkpoints" / step_dir(run).name)
    for source in (partial, lone_run):
        out = tmp_path / f"out-{source.name}"
        assert main(["export", "--checkpoint", str(source), "--to", str(out)]) == 5  # a checkpoint error
        err = one_line_error(capsys)
        assert str(source) in err and "complete" in err
        assert not out.exists()


def test_corrupt_checkpoint_is_refused_naming_the_file(tmp_path, capsys, run):
    bad = tmp_path / "bad-run"
    shutil.copytree(run, bad)
    for older in (bad / "checkpoints").glob("step-*"):  # the newest alone: no earlier checkpoint to fall back to
        if older.name != step_dir(run).name:
            shutil.rmtree(older)
    victim = max((bad / "checkpoints" / step_dir(run).name).glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", str(bad), "--to", str(out)]) == 5  # a checkpoint error
    err = one_line_error(capsys)
    assert victim.name in err and "fails its checksum" in err
    assert not out.exists()


def test_missing_source_and_unknown_format_are_one_line_errors(tmp_path, capsys, run):
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", str(tmp_path / "nope"), "--to", str(out)]) == 2
    assert "nope" in one_line_error(capsys)
    assert main(["export", "--checkpoint", str(run), "--to", str(out), "--format", "onnx"]) == 2
    err = one_line_error(capsys)
    assert "'onnx'" in err and "'hf'" in err and "'safetensors'" in err
    assert not out.exists()


def test_convert_from_a_run_uses_the_same_export(tmp_path, capsys, run, trained):
    out = tmp_path / "zaya"
    assert main(["convert", "--to", "zaya", "--src", str(run), "--dst", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"zaya.json", "model.safetensors", "tokenizer.json", "SHA256SUMS"}
    assert_same_tensors(load_pretrained(out), trained)


def test_python_m_zaya_export(tmp_path, run, trained):
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "zaya", "export", "--checkpoint", str(run), "--to", str(out),
                           "--format", "safetensors"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: safetensors")
    assert_same_tensors(load_pretrained(out), trained)
