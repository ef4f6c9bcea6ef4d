"""`zaya data` against inputs an attacker or an accident shaped: a JSON Lines line nested 100,000 deep, text with
an unpaired surrogate escape ("\\ud800": ended in "'utf-8' codec can't encode character", naming no file), a
manifest.json nested 100,000 deep (exit 70) or holding a list, and a killed prepare's owner record of the wrong
kind. Each is skipped and counted like other bad input, or an error naming the file (and line) and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zaya.cli import main
from zaya.data.bundle import MANIFEST, DatasetError, PreparedDataset
from zaya.data.prepare import PrepareOptions, prepare
from zaya.data.sources import InputError

DEEP = "[" * 100_000 + "]" * 100_000
DOC = "To be, or not to be, that is the question. " * 4


def prepare_jsonl(tmp_path: Path, lines: list[str], out: str = "ds", **kw):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    logs: list[str] = []
    result = prepare(PrepareOptions(inputs=[str(path)], out=str(tmp_path / out), vocab_size=320, val_fraction=0.0,
                                    **kw), log=logs.append)
    return path, result, logs


def test_a_jsonl_line_nested_100k_deep_is_skipped_and_counted_or_named_with_strict(tmp_path):
    path, result, logs = prepare_jsonl(tmp_path, [DEEP, json.dumps({"text": DOC})])
    assert result.manifest["stats"]["bad_lines"] == 1 and result.manifest["stats"]["documents"] == 1
    assert f"  {path}:1: skipped, not valid JSON (JSON nested too deeply to parse)" in logs
    with pytest.raises(InputError, match=rf"{path}:1: not valid JSON \(JSON nested too deeply"):
        prepare_jsonl(tmp_path, [DEEP, json.dumps({"text": DOC})], out="strict", strict=True)
    assert not (tmp_path / "strict").exists()


def test_a_lone_surrogate_escape_is_replaced_and_counted_like_invalid_utf8(tmp_path):
    lines = ['{"text": "abc\\ud800def ' + DOC + '"}', '{"text": "pair \\ud83c\\udfad kept, lone low \\udfad"}',
             json.dumps({"text": DOC})]
    path, result, logs = prepare_jsonl(tmp_path, lines)
    stats = result.manifest["stats"]
    assert stats["decode_errors"] == 2 and stats["documents"] == 3 and stats["bad_lines"] == 0
    assert f"  {path}:1: 1 unpaired surrogate escape(s) in the text, replaced" in logs
    assert any("2 invalid UTF-8 sequence(s) or unpaired surrogate escape(s) replaced by U+FFFD" in m for m in logs)
    dataset = PreparedDataset(tmp_path / "ds")
    tokenizer = dataset.tokenizer()
    docs = [tokenizer.decode(ids[:-1]) for ids in dataset.split("train").documents()]
    assert docs == ["abc\ufffddef " + DOC, "pair \U0001f3ad kept, lone low \ufffd", DOC]
    with pytest.raises(InputError, match=rf"{path}:2: an unpaired surrogate escape \('\\udfad'\) at character 22"):
        prepare_jsonl(tmp_path, lines[2:0:-1], out="strict", strict=True)  # the pair passes, the lone one not


def test_zaya_data_prepare_with_a_lone_surrogate_exits_0_and_names_the_line(tmp_path, capsys):
    """End to end through the CLI's main (in this process: a `zaya` subprocess only adds a torch start-up): the
    audit's input (50 lines, each with "\\ud800") exited 2 naming neither file nor line."""
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join('{"text": "abc\\ud800def ' + DOC + '"}' for _ in range(50)) + "\n")
    code = main(["data", "prepare", "--input", str(path), "--out", str(tmp_path / "ds"), "--vocab-size", "320"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"{path}:1: 1 unpaired surrogate escape(s) in the text, replaced" in err
    assert json.loads((tmp_path / "ds" / MANIFEST).read_text())["stats"]["decode_errors"] == 50


@pytest.mark.parametrize("content,needle", [
    ('{"format": "zaya-dataset", "splits": ' + DEEP + "}", "not valid JSON (JSON nested too deeply to parse)"),
    ("[1, 2]", "a JSON list, not a manifest's object"),
    ('{"format": "zaya-dataset", "x": "\\udc80"', "not valid JSON"),
])
def test_a_manifest_that_is_not_a_manifest_is_a_data_error_naming_it(tmp_path, capsys, content, needle):
    path, _, _ = prepare_jsonl(tmp_path, [json.dumps({"text": DOC})])
    (tmp_path / "ds" / MANIFEST).write_text(content)
    with pytest.raises(DatasetError, match="prepare the dataset again") as err:
        PreparedDataset(tmp_path / "ds")
    assert str(err.value).startswith(f"{tmp_path / 'ds' / MANIFEST}: ") and needle in str(err.value)
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "ds")]) == 3
    err = capsys.readouterr().err
    assert err.startswith("zaya: error: ") and str(tmp_path / "ds" / MANIFEST) in err and "Traceback" not in err


@pytest.mark.parametrize("owner", [DEEP, "[1]", '{"host": "h", "pid": Infinity, "started": 1.0}',
                                   '{"host": "h", "pid": 12, "started": NaN}', '{"host": 5, "pid": 12}'])
def test_a_killed_prepares_owner_record_of_the_wrong_kind_is_no_owner(tmp_path, owner):
    from zaya.data import leftovers

    folder = tmp_path / ".ds.tmp-x"
    folder.mkdir()
    (folder / leftovers.OWNER).write_text(owner)
    logs: list[str] = []
    assert leftovers.sweep(tmp_path / "ds", logs.append) == []
    assert folder.is_dir() and any("no owner record" in line for line in logs), logs
