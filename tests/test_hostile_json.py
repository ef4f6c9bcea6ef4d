"""JSON files a run, its supervisor and the tuner read back, nested 100,000 deep or of the wrong kind: the json
module raises RecursionError there, which ``except ValueError`` let through as a traceback. Each reader now parses
with ``zaya.core.fsutil`` and either names the file in a zaya error or treats the file as what it is (no lock holder's
record, no RAM-tier copy, no owner, a line to skip)."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from zaya.core.errors import ConfigError

DEEP = "[" * 100_000 + "]" * 100_000


def test_metrics_jsonl_with_a_deep_line_is_an_error_naming_the_line(tmp_path):
    from zaya.train.plot import read_metrics

    (tmp_path / "metrics.jsonl").write_text(f'{{"kind": "train", "step": 1, "loss": 2.0}}\n{DEEP}\n'
                                            '{"kind": "train", "step": 2, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'metrics.jsonl'}:2: not a JSON object \(JSON nested too "):
        read_metrics(tmp_path)


def test_a_held_run_lock_whose_record_is_not_json_is_refused_as_an_unnamed_holder(tmp_path):
    from zaya.train.run_lock import JOB_LOCK, lock_run_dir

    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run / JOB_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a holder whose record is hostile
        os.pwrite(fd, DEEP.encode(), 0)
        with pytest.raises(ConfigError, match="in use by a process that has not said who it is"):
            lock_run_dir(run, "zaya train", lambda text: None)
    finally:
        os.close(fd)


def test_ram_tier_info_and_owner_records_nested_deep_are_no_copy_and_no_ended_run(tmp_path):
    from zaya.checkpoint import ram_owners
    from zaya.checkpoint.ram_tier import RamTier

    directory = tmp_path / "shm" / "run-abc"
    directory.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "shm", 0o700)
    tier = RamTier(directory, tmp_path / "run", 0, 1, "ddp")
    tier.data_path.write_bytes(b"x")
    tier.info_path.write_text(DEEP)
    assert tier.holds(1, "save") is False
    for record in (DEEP, "[1]", json.dumps({"process": {"host": "h", "pid": 1e400, "started": 1.0}})):
        (directory / f"rank-00000{ram_owners.OWNER_SUFFIX}").write_text(record.replace("1e400", "Infinity"))
        assert ram_owners.ended(directory) is False


def test_tune_files_nested_deep_are_config_errors_naming_them(tmp_path):
    from zaya.tune.gemm.command import _from_saved
    from zaya.tune.plan import mfu_from_metrics
    from zaya.core.hardware import read_profile

    path = tmp_path / "profile.json"
    path.write_text(DEEP)
    with pytest.raises(ConfigError, match=rf"{path}: not valid JSON \(JSON nested too deeply"):
        read_profile(path)
    path.write_bytes(b'{"version": "\xff"}')
    with pytest.raises(ConfigError, match=rf"{path}: not valid JSON"):
        read_profile(path)
    with pytest.raises(ConfigError, match=rf"--from {path}: not a `zaya tune gemm` result"):
        _from_saved(str(path))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join([DEEP, '{"mfu": 0.5}', '{"mfu": 0.25}', '{"mfu": 0.75}']) + "\n")
    assert mfu_from_metrics(metrics) == 0.5
    saved = tmp_path / "gemm.json"
    saved.write_text(json.dumps({"model": {"num_layers": 2**70}, "micro_batch_size": 1, "seq_len": 8}))
    with pytest.raises(ConfigError, match=rf"{saved}\.num_layers = {2**70}: must be an integer in \[1, 4096\)"):
        _from_saved(str(saved))
