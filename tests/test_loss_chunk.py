"""The fused cross-entropy's row chunk by device kind (``HardwareProfile.loss_chunk_elements``): cache-sized on a CPU,
memory-sized on a GPU, where the CPU's 16-row chunks at ZAYA1's vocabulary made ~1,000 launch-bound chunks per
micro-batch. Checked without a GPU, through the profile a GPU device gets when nothing was measured."""

from __future__ import annotations

import math

import pytest
import torch

from zaya.config import ModelConfig
from zaya.core import hardware
from zaya.model import loss as zloss

VOCAB = ModelConfig().vocab_size  # ZAYA1's 262,272
TOKENS = 16_384  # one 16k-token micro-batch
GPU = torch.device("cuda")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """No profile file anywhere (the defaults), and torch naming a GPU it does not have."""
    monkeypatch.setenv("ZAYA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(hardware.PROFILE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    hardware.clear_cache()
    yield
    hardware.clear_cache()


def test_gpu_chunks_are_few_and_cpu_chunks_unchanged(private_cache):
    rows = zloss._chunk_rows(VOCAB, GPU)
    assert hardware.load_profile(GPU).loss_chunk_elements == hardware.GPU_LOSS_CHUNK_ELEMENTS
    assert rows == 1023 and math.ceil(TOKENS / rows) == 17  # was 16 rows, 1,024 chunks
    assert 2 * rows * VOCAB * 4 <= 2 * 2**30  # the two reused fp32 buffers: at most 2 GiB together
    cpu = torch.device("cpu")
    assert hardware.load_profile(cpu).loss_chunk_elements == 1 << 19  # measured on the CPU: kept
    assert zloss._chunk_rows(VOCAB, cpu) == zloss.MIN_CHUNK_ROWS


def test_gpu_profile_written_by_tune_keeps_the_gpu_chunk(private_cache):
    """``zaya tune`` updates only its own fields: a GPU's file starts from the GPU's defaults."""
    path = hardware.update_profile(GPU, ddp_bucket_mb=50.0)
    hardware.clear_cache()
    assert hardware.read_profile(path).loss_chunk_elements == hardware.GPU_LOSS_CHUNK_ELEMENTS
    assert hardware.load_profile(GPU).device_key == "cuda-nvidia-h200"
