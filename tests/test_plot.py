"""`zaya.train.plot`: reading metrics.jsonl (resumes, truncated last line, bad lines) and writing the run's PNGs."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from zaya.cli import main
from zaya.train.plot import PLOT_FILES, plot_run, read_metrics

pytestmark = pytest.mark.plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYERS, EXPERTS = 3, 4


def train_record(step, tokens, stage, *, resumed=False, layers=LAYERS, experts=EXPERTS, skip=True, **extra):
    load, ratios, skips = [], [], []
    for layer in range(layers):
        skip_share = 0.1 + 0.02 * layer if skip else 0.0
        weights = [1.0 + ((step + layer + e) % 3) * 0.2 for e in range(experts)]
        row = [(1 - skip_share) * w / sum(weights) for w in weights] + ([skip_share] if skip else [])
        load.append(row)
        ratios.append(max(row[:experts]) / ((1 - skip_share) / experts))
        skips.append(skip_share)
    record = {"kind": "train", "step": step, "loss": 6.0 - 0.05 * step + (0.5 if resumed else 0.0),
              "lr": 1e-3 * min(1.0, step / 10), "grad_norm": 1.0 + 0.1 * (step % 4), "tokens": tokens,
              "tokens_per_s": 50_000.0 + 100 * step, "step_time_s": 0.5, "mfu": 0.3 + 0.001 * step, "stage": stage,
              "seq_len": 512 if stage == "pretrain" else 2048,
              "global_batch_tokens": 1000 if stage == "pretrain" else 2000, "expert_load": load,
              "expert_load_max_over_mean": ratios, "expert_load_cv": [0.1 * r for r in ratios],
              "expert_load_entropy": [0.99] * layers, "router_token_entropy": [0.9 - 0.01 * step] * layers,
              "router_flip_rate": None if step == 1 else [0.05 * (layer + 1) for layer in range(layers)],
              "time": 1.7e9 + step}
    if skip:
        record["skip_fraction"] = skips
    if resumed:
        record["resumed"] = True
    record.update(extra)
    return record


def tokens_at(step):
    return 1000 * min(step, 40) + 2000 * max(0, step - 40)


def val_record(step, val_loss):
    return {"kind": "val", "step": step, "tokens": tokens_at(step), "val_loss": val_loss,
            "val_ppl": 2.718281828 ** val_loss, "time": 1.7e9 + step}


def write_run(run_dir: Path) -> Path:
    """Steps 1-40 'pretrain', 41-50 'long-context', then a resume from step 45's checkpoint that rewrites 46-50 and
    goes on to 60 (skipping step 55), and a crash that leaves half a line at the end. Val every 10 steps (val 50
    written twice)."""
    lines = []
    for step in range(1, 51):
        lines.append(train_record(step, tokens_at(step), "pretrain" if step <= 40 else "long-context"))
        if step % 10 == 0:
            lines.append(val_record(step, 5.0 - 0.01 * step))
    lines.append({"kind": "checkpoint", "step": 45})  # another kind: ignored
    for step in range(46, 61):
        if step == 55:  # a batch skipped for a non-finite loss: the trainer logs no stage, lr, load...
            lines.append({"kind": "train", "step": 55, "skipped": True, "resumed": True, "loss": float("nan"),
                          "tokens": tokens_at(55), "time": 1.7e9 + 55})
            continue
        lines.append(train_record(step, tokens_at(step), "long-context", resumed=True))
        if step % 10 == 0:
            lines.append(val_record(step, 4.0 - 0.01 * step))
    text = "".join(json.dumps(r) + "\n" for r in lines)
    text += json.dumps(train_record(61, tokens_at(61), "long-context"))[:57]  # crash mid-write, no newline
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("plot") / "run")


@pytest.fixture(scope="module")
def plotted(run_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plot_run(run_dir)


def assert_pngs(paths, directory):
    assert [p.name for p in paths] == list(PLOT_FILES)
    for path in paths:
        assert path.parent == directory
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), path
    assert sorted(p.name for p in directory.iterdir()) == sorted(PLOT_FILES)  # no temporary files left behind


def test_read_metrics_resolves_resume_and_skips_truncated_last_line(run_dir):
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:\d+: skipped an incomplete last line"):
        train, val = read_metrics(run_dir)
    assert [r["step"] for r in train] == list(range(1, 61))
    assert not any(r.get("resumed") for r in train[:45])  # before the resume point: the original records
    assert all(r.get("resumed") for r in train[45:])  # 46-50 from the resumed run replace the first run's
    assert [r["step"] for r in val] == [10, 20, 30, 40, 50, 60]
    assert val[4]["val_loss"] == pytest.approx(4.0 - 0.5)  # the resumed run's step-50 evaluation wins
    assert train[54].get("skipped") is True and "stage" not in train[54]
    from zaya.train.plot import _Run

    run = _Run(train, val, "run")  # the skipped step stays in its stage: two stages, one boundary
    assert run.segments() == [(0, "pretrain"), (40, "long-context")]
    assert run.skipped.sum() == 1 and run.by_tokens


def test_resume_to_an_earlier_step_drops_later_records(tmp_path):
    records = [train_record(s, s * 1000, "a") for s in (10, 20, 30, 40)] + [train_record(25, 25_000, "a"),
                                                                          train_record(35, 35_000, "a")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train, val = read_metrics(tmp_path)
    assert [r["step"] for r in train] == [10, 20, 25, 35] and val == []


def test_garbage_line_in_the_middle_is_an_error_with_its_line_number(tmp_path):
    good = json.dumps(train_record(1, 1000, "a"))
    (tmp_path / "metrics.jsonl").write_text(f"{good}\n\n{good[:30]}\n{good}\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3: not a JSON object"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(f'{good}\n{{"kind": "val", "val_loss": 3.0}}\n{good}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: val record without an integer 'step'"):
        read_metrics(tmp_path)


def test_missing_file_or_no_train_records_is_a_value_error_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "metrics.jsonl")):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(val_record(10, 3.0)) + "\n")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'metrics.jsonl'} holds no train records"):
        plot_run(tmp_path)
    assert not (tmp_path / "plots").exists()


def test_plot_run_writes_every_png_into_run_dir_plots(run_dir, plotted):
    assert_pngs(plotted, run_dir / "plots")


def test_plot_run_without_tokens_mfu_or_skip_class_and_many_layers(tmp_path):
    """Fallbacks: step on the x axis, no MFU twin, no skip row, a grid of small panels, no val records."""
    records = [train_record(s, None, "a" if s < 8 else "b", layers=10, experts=16, skip=False, mfu=None)
               for s in range(1, 13)]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "elsewhere" / "pngs"
    paths = plot_run(tmp_path / "run", out_dir=out)
    assert_pngs(paths, out)
    assert not (tmp_path / "run" / "plots").exists()


def test_cli_plot(run_dir, tmp_path, capsys):
    out = tmp_path / "cli-plots"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"wrote {out / name}" for name in PLOT_FILES]
    assert_pngs([out / name for name in PLOT_FILES], out)

    assert main(["plot", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zaya: error: ") and "nope" in err and err.count("\n") == 1


def test_routing_columns_keep_layers_and_mark_missing_values_nan():
    from zaya.train.plot import _layer_columns

    records = [{"router_flip_rate": None}, {"router_flip_rate": [0.1, None, 0.3]}, {}, {"router_flip_rate": [0.2]}]
    got = _layer_columns(records, "router_flip_rate")
    assert got.shape == (4, 3)
    assert got[1, 0] == 0.1 and got[1, 2] == 0.3 and got[3, 0] == 0.2
    assert np.isnan(got[0]).all() and np.isnan(got[1, 1]) and np.isnan(got[2]).all() and np.isnan(got[3, 1:]).all()
