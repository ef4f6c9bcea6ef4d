"""zaya.core.fsutil's JSON reading: every way a file can fail to be JSON is a ValueError the caller names."""

import pytest

from zaya.core.fsutil import loads_json, read_json


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 100_000, b"\xff\xfe{", "{", ""])
def test_anything_that_does_not_parse_is_a_value_error(tmp_path, text):
    with pytest.raises(ValueError):
        loads_json(text)
    path = tmp_path / "f.json"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    with pytest.raises(ValueError):
        read_json(path)


def test_json_reads_as_json(tmp_path):
    (tmp_path / "f.json").write_text('{"a": [1, 2.5, "\\u00e9"]}', encoding="utf-8")
    assert read_json(tmp_path / "f.json") == {"a": [1, 2.5, "é"]} == loads_json(b'{"a": [1, 2.5, "\\u00e9"]}')


@pytest.mark.parametrize("durable, syncs", [(True, 2), (False, 0)])
def test_atomic_write_replaces_whole_and_fsyncs_only_when_durable(tmp_path, monkeypatch, durable, syncs):
    import os

    from zaya.core.fsutil import atomic_write_text, umask

    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    path = tmp_path / "new" / "beat.json"
    atomic_write_text(path, "old", durable=durable)
    calls.clear()
    atomic_write_text(path, '{"step": 2}', durable=durable)
    assert path.read_text() == '{"step": 2}' and len(calls) == syncs  # the file, then its directory
    assert [p.name for p in path.parent.iterdir()] == ["beat.json"]  # no temporary file left
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask()
