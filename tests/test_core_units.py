"""`zaya.core.units`: the one set of count, byte and duration formatters and size/count parsers."""

import pytest

from zaya.core.errors import ConfigError
from zaya.core.units import GiB, KiB, MiB, format_bytes, format_count, format_duration, parse_count, parse_size


@pytest.mark.parametrize("n, digits, text", [
    (0, 3, "0"), (512, 3, "512"), (999, 3, "999"), (2.5, 3, "2.5"), (1000, 3, "1k"), (1234567, 3, "1.23M"),
    (8.3e9, 3, "8.3B"), (1.5e12, 3, "1.5T"), (-2.5e6, 3, "-2.5M"), (12_345_678, 4, "12.35M"), (760e6, 2, "760M"),
    (999.4, 3, "999"), (0.0123, 2, "0.012"), (7.0, 3, "7"),
])
def test_format_count(n, digits, text):
    assert format_count(n, digits) == text


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (100, "100 B"), (KiB, "1 KiB"), (4 * KiB, "4 KiB"), (64 * MiB, "64 MiB"), (1.5 * GiB, "1.5 GiB"),
    (3 * 1024 * GiB, "3 TiB"), (1234567, "1.18 MiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("seconds, text", [
    (3 * 86400, "3.0 days"), (5 * 3600, "5.0 h"), (3600, "60.0 min"), (150, "2.5 min"), (119, "119.0 s"),
    (1.0, "1.0 s"), (0.0123, "12.3 ms"), (4.5e-4, "450 us"), (8e-8, "80 ns"), (0, "0.0 s"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("parse, text, value", [
    (parse_size, "4096", 4096), (parse_size, "4K", 4 * KiB), (parse_size, "4KiB", 4 * KiB),
    (parse_size, "4kb", 4 * KiB),
    (parse_size, "64M", 64 * MiB), (parse_size, "1.5G", 3 * GiB // 2), (parse_size, " 1 gib ", GiB),
    (parse_size, "2T", 2 * 1024 * GiB), (parse_count, "760M", 760_000_000), (parse_count, "8.3B", 8_300_000_000),
    (parse_count, "2.5e6", 2_500_000), (parse_count, "123_456", 123456), (parse_count, "1,000", 1000),
    (parse_count, "4k", 4000), (parse_count, "1G", 10**9), (parse_count, "1.5T", 1_500_000_000_000),
])
def test_parsers(parse, text, value):
    assert parse(text, "--option") == value


@pytest.mark.parametrize("parse, text", [(parse_size, t) for t in ("", "4Q", "-1K", "K", "0", "0.1")]
                         + [(parse_count, t) for t in ("", "x", "-5M", "0", "nanM", "infB")])
def test_parsers_refuse_naming_the_option(parse, text):
    with pytest.raises(ConfigError, match="--option"):
        parse(text, "--option")
