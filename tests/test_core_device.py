"""`zaya.core.device`'s one dtype map: names (as configs, options and files write them) to torch dtypes and back."""

import pytest
import torch

from zaya.core.device import DTYPES, dtype_name, short_name, to_dtype


@pytest.mark.parametrize("given, dtype", [
    ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
    ("float32", torch.float32), ("fp32", torch.float32), ("fp16", torch.float16), ("torch.int64", torch.int64),
    (torch.float16, torch.float16),
])
def test_to_dtype_reads_every_spelling(given, dtype):
    assert to_dtype(given) is dtype


@pytest.mark.parametrize("name", ["bfloat", "torch.Tensor", "nn", ""])
def test_a_name_that_is_no_dtype_is_a_value_error(name):
    with pytest.raises(ValueError, match="is not a torch dtype"):
        to_dtype(name)


def test_names_round_trip():
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name == dtype_name(short_name(dtype)) and to_dtype(name) is dtype
    assert [short_name(d) for d in ("bfloat16", torch.float32, "torch.int8")] == ["bf16", "fp32", "int8"]


@pytest.mark.parametrize("flags, expected", [({"avx2", "fma"}, "float32"), ({"avx512f", "avx512_bf16"}, "bfloat16"),
                                             ({"amx_bf16", "amx_tile"}, "bfloat16"), ({"asimd", "bf16"}, "bfloat16"),
                                             (set(), "float32")])
def test_auto_compute_dtype_is_bf16_only_where_the_cpu_multiplies_it(monkeypatch, flags, expected):
    """train.dtype = "auto" (the default): an AVX2 CPU emulates bf16 matmuls (17x slower for the tiny model's step),
    so it trains in fp32; AVX-512 BF16, AMX and Arm BF16 CPUs and GPUs in bf16; an explicit choice is kept."""
    from zaya.core import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    assert hardware.compute_dtype("auto", torch.device("cpu")) == expected
    assert hardware.compute_dtype("bfloat16", "cpu") == "bfloat16" and hardware.compute_dtype("float32", "cpu") == \
        "float32"
    assert hardware.compute_dtype("auto", "cuda") == "bfloat16"  # planning for a GPU this machine does not have


def test_cpu_flags_are_read_from_proc_cpuinfo():
    from zaya.core.hardware import cpu_flags

    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        line = next(line for line in fh if line.split(":")[0].strip() in ("flags", "Features"))
    assert cpu_flags() == frozenset(line.split(":", 1)[1].split())
