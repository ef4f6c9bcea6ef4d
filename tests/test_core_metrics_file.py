"""`zaya.core.metrics_file`: metrics.jsonl written (torn lines cut) and read back with a resumed step's later
record winning, strictly (zaya plot) or leniently (the supervisor, the planner)."""

import json
import math

import pytest

from zaya.core.metrics_file import MetricsWriter, latest_wins, parse_records, read_metrics, step_of, stepped_records


def rec(kind, step, **extra):
    return {"kind": kind, "step": step, **extra}


def test_writer_appends_flushed_lines_and_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(rec("train", 1)) + "\n" + '{"kind": "tra')  # a crash mid-write
    writer = MetricsWriter(path)
    writer.write(rec("train", 2, loss=float("nan")))
    assert path.read_text().splitlines()[-1] == '{"kind": "train", "step": 2, "loss": NaN}'  # flushed, not closed
    writer.close()
    assert [r["step"] for r in read_metrics(path, strict=True)["train"]] == [1, 2]
    path.write_text('{"kind": "train", "step": 1')  # only a torn line: nothing kept
    MetricsWriter(path).close()
    assert path.read_bytes() == b""


def test_latest_wins_drops_the_earlier_records_from_a_resumed_step_on():
    steps = [1, 2, 3, 4, 5, 3, 4, 2, 3]
    assert [r["step"] for r in latest_wins(rec("train", s, n=i) for i, s in enumerate(steps))] == [1, 2, 3]
    kept = latest_wins(rec("train", s, n=i) for i, s in enumerate([1, 2, 2, 3]))
    assert [(r["step"], r["n"]) for r in kept] == [(1, 0), (2, 2), (3, 3)]  # a repeated step: its later record


def test_read_metrics_resolves_resumes_per_kind_and_ignores_other_kinds(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [rec("train", s, run=0) for s in range(1, 11)] + [rec("val", 10, run=0), rec("checkpoint", 8)]
    lines += [rec("train", s, run=1) for s in range(9, 13)] + [rec("val", 10, run=1), {"no": "kind"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = read_metrics(path)
    assert [(r["step"], r["run"]) for r in got["train"]] == [(s, 0) for s in range(1, 9)] + [(s, 1) for s in
                                                                                               range(9, 13)]
    assert [(r["step"], r["run"]) for r in got["val"]] == [(10, 1)]
    assert read_metrics(path, kinds=("checkpoint",)) == {"checkpoint": [rec("checkpoint", 8)]}


def test_lenient_reading_skips_what_is_not_a_record_strict_names_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps(rec("train", 1))
    path.write_text(f"{good}\n[1, 2]\n{'[' * 100_000}\n{json.dumps(rec('train', 'x'))}\n"
                    f"{json.dumps(rec('train', 2.0))}\n{json.dumps(rec('train', True))}\n{good[:9]}")
    assert [r["step"] for r in read_metrics(path)["train"]] == [1, 2]  # 2.0 is a whole float: step 2
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON object \(a JSON list, not an object\)"):
        read_metrics(path, strict=True)
    path.write_text(f"{good}\n{json.dumps(rec('val', None))}\n")
    with pytest.raises(ValueError, match=rf"{path}:2: val record without an integer 'step'"):
        read_metrics(path, strict=True)
    path.write_text(f"{good}\n{good[:9]}\n\n")  # a torn last line (blank lines after it do not count)
    with pytest.warns(UserWarning, match=rf"{path}:2: skipped an incomplete last line"):
        assert [r["step"] for r in read_metrics(path, strict=True)["train"]] == [1]


def test_parse_records_numbers_lines_and_step_of_takes_only_whole_steps():
    data = b'\n{"step": 3}\r\nnot json\n{"step": 4.5}\n'
    assert [(n, r) for n, _, r in parse_records(data)] == [(2, {"step": 3}), (4, {"step": 4.5})]
    assert [step_of(r) for r in ({"step": 3}, {"step": 3.0}, {"step": 4.5}, {"step": False}, {}, {"step": "3"},
                                 {"step": math.inf})] == [3, 3, None, None, None, None, None]


def test_stepped_records_keeps_every_kind_with_a_whole_step_in_file_order():
    data = b'{"kind": "val", "step": 2.0}\n[1]\n{"kind": "x", "step": 1}\n{"kind": "train", "step": "3"}\n'
    assert stepped_records(data) == [{"kind": "val", "step": 2}, {"kind": "x", "step": 1}]
