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
