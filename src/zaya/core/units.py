"""Numbers for people: counts, bytes and durations written short, and the parsers of sizes and counts.

One set for every report, log line, plot axis and option, so that "1.5B", "64 MiB" and "2.0 h" mean one thing
everywhere: counts in powers of 1000 (k, M, B, T), bytes in powers of 1024 (KiB, MiB, GiB, TiB).
"""

from __future__ import annotations

import math
import re

from zaya.core.errors import ConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
COUNT_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3))
BYTE_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_SIZE_SUFFIXES = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB, "g": GiB,
                  "gb": GiB, "gib": GiB, "t": TiB, "tb": TiB, "tib": TiB}
_COUNT_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def significant(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits, never in exponent form and without trailing zeros: 1.2345 ->
    "1.23", 760.4 -> "760", 2.50 -> "2.5" (a whole part longer than ``digits`` is kept whole)."""
    whole = len(str(int(abs(x)))) if abs(x) >= 1 else -_leading_zeros(x)
    text = f"{x:.{max(0, digits - whole)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _leading_zeros(x: float) -> int:
    """0.0123 -> 1: the zeros after the point before the first significant digit (0 for 0 itself)."""
    return 0 if x == 0 else max(0, -math.floor(math.log10(abs(x))) - 1)


def format_count(n: float, digits: int = 3) -> str:
    """``n`` with ``digits`` significant digits and a k/M/B/T suffix: 1234567 -> "1.23M", 760e6 -> "760M"; below
    1000 without a suffix (512 -> "512", 2.5 -> "2.5")."""
    for suffix, scale in COUNT_UNITS:
        if abs(n) >= scale:
            return significant(n / scale, digits) + suffix
    return significant(n, digits)


def format_bytes(n: float, digits: int = 3) -> str:
    """``n`` bytes in the largest binary unit it fills, to ``digits`` significant digits: 65536 -> "64 KiB",
    1.5 GiB -> "1.5 GiB", 100 -> "100 B"."""
    for unit, scale in BYTE_UNITS:
        if abs(n) >= scale:
            return f"{significant(n / scale, digits)} {unit}"
    return f"{n:.0f} B"


def format_duration(seconds: float) -> str:
    """A duration in the unit a person reads it in: "3.1 days", "5.2 h", "12.5 min" (from twice the unit up),
    "42.0 s"; below a second "12.3 ms", "450 us", "80 ns" (3 significant digits)."""
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * scale:
            return f"{seconds / scale:.1f} {unit}"
    if seconds >= 1 or seconds <= 0:
        return f"{seconds:.1f} s"
    for unit, scale in (("ms", 1e3), ("us", 1e6)):
        if seconds * scale >= 1:
            return f"{seconds * scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def parse_size(text: str, what: str) -> int:
    """Bytes of "4096", "4K", "4KiB", "64M", "1.5G", "1T" (binary units; B, KB and KiB alike). A ConfigError naming
    ``what`` (the option or key) when ``text`` is not a size of at least one byte."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _SIZE_SUFFIXES.get(m.group(2).lower())
    if not m or unit is None:
        raise ConfigError(f"{what}: {text!r} is not a size (use bytes or K/M/G, e.g. 4K, 64MiB)")
    size = int(float(m.group(1)) * unit)
    if size < 1:
        raise ConfigError(f"{what}: {text!r} must be at least one byte")
    return size


def parse_count(text: str, what: str) -> int:
    """"760M", "8.3B", "2.5e6", "123_456", "1,000" -> a positive integer (k = 1e3, M = 1e6, B or G = 1e9,
    T = 1e12). A ConfigError naming ``what`` otherwise."""
    s = str(text).strip().replace("_", "").replace(",", "")
    mult = _COUNT_SUFFIXES.get(s[-1:].lower(), 1.0) if s else 1.0
    body = s[:-1] if mult != 1.0 else s
    try:
        value = float(body) * mult
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} = {text!r}: give a positive count such as 760M, 8.3B or 123456")
    return int(round(value))
