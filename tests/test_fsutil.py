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
