"""One hardware profile per device: the measured constants zaya tunes itself by, in one file; and the device's
peak FLOP/s that MFU is measured against (``device_peak_flops``).

Constants that depend on the machine (the Newton-Schulz block size on CPU, the row chunk of the fused
cross-entropy, the peak FLOP/s MFU is measured against, the DDP gradient bucket size) used to live as literals in
the modules that use them. They now come from a ``HardwareProfile``: the defaults below (what those literals were,
measured on the 2-core AMD EPYC development VM, benchmarks/results.md; the loss chunk by device kind) unless ``zaya tune gemm`` / ``zaya tune
comm`` have written a profile for this device, which is then read once per process.

Where profiles live: ``$ZAYA_HARDWARE_PROFILE`` (one file, used for every device; an explicit choice, so a missing
or broken file is an error), else ``<cache>/hardware/<device key>.json`` with ``<cache>`` = ``$ZAYA_CACHE_DIR`` or
``~/.cache/zaya``. The device key names the device and, on CPU, the thread count, since both change the answers:
``cpu-amd-epyc-7b13-2t``, ``cuda-nvidia-h200``. A cached profile that cannot be read is an error naming the file
and the fix (delete it or rerun the tune command), never silently replaced by defaults.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from zaya.core.device import dtype_name, short_name, synchronize, to_dtype
from zaya.core.errors import ConfigError
from zaya.core.fsutil import atomic_write_text, cache_root, read_json

PROFILE_VERSION = 1
PROFILE_ENV = "ZAYA_HARDWARE_PROFILE"

# Dense bf16 peak of one device, FLOP/s, by a substring of torch.cuda.get_device_name() (vendors' datasheets).
DATASHEET_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "MI300X": 1307e12, "MI325X": 1307e12,
                        "MI250X": 383e12, "L40S": 362e12, "A10G": 125e12, "B200": 2250e12}


CPU_LOSS_CHUNK_ELEMENTS = 1 << 19
GPU_LOSS_CHUNK_ELEMENTS = 1 << 28


@dataclass
class HardwareProfile:
    """What zaya knows about one device; every field has the default used when nothing was measured."""

    device_key: str = ""
    """The device this profile describes (``device_key()``); "" in a profile made of defaults only."""
    device_name: str = ""
    """Human-readable device name (CPU model and threads, or the GPU's name)."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Measured dense matmul peak FLOP/s by dtype name ("bfloat16", "float32"); empty = not measured (MFU then
    uses ``train.peak_flops``, a datasheet figure, or a quick measurement)."""
    muon_block_rows: int = 256
    """CPU Newton-Schulz: the smallest row block of the blocked (triangle-only) Gram/X·Xᵀ products."""
    muon_max_blocks: int = 8
    """CPU Newton-Schulz: at most this many row blocks per matrix."""
    muon_cpu_small: int = 256
    """CPU Newton-Schulz: matrices with a side below this run batched (unblocked) matmuls."""
    loss_chunk_elements: int = CPU_LOSS_CHUNK_ELEMENTS
    """Fused cross-entropy: fp32 elements per row chunk of the logits. Default by device kind
    (``default_profile``): on a CPU 2^19 (2 MB, about the L2 of the development CPU: the chunk stays in cache between
    its passes); on a GPU 2^28 (1 GiB, each of the loss's two reused fp32 buffers): sized by memory, not by a cache,
    so that each chunk's kernels run long against their launches (1,023 rows at a 262,272 vocabulary, 17 chunks
    per 16k-token micro-batch, where 2^19 made 1,024)."""
    ddp_bucket_mb: float = 25.0
    """DDP / ZeRO-1 gradient bucket size in MiB (``bucket_cap_mb``; 25 is torch's default)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free each block's gathered parameters after its forward (False trades memory for one all-gather
    fewer per block in the backward)."""
    gemm: dict[str, Any] = field(default_factory=dict)
    """``zaya tune gemm``'s summary (dtype, best shapes, recommendation); informational."""
    comm: dict[str, Any] = field(default_factory=dict)
    """``zaya tune comm``'s summary (bandwidth by collective, message size and ranks); informational."""
    version: int = PROFILE_VERSION
    """Profile format version."""
    path: str = field(default="", compare=False)
    """Where this profile was read from ("" = defaults); not written to the file."""

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("path")
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


def default_profile(device: torch.device | str) -> HardwareProfile:
    """The profile of ``device`` when nothing was measured: the field defaults, with the loss chunk of its kind
    (a CPU's, or a GPU's for every other device)."""
    if torch.device(device).type == "cpu":
        return HardwareProfile()
    return HardwareProfile(loss_chunk_elements=GPU_LOSS_CHUNK_ELEMENTS)


_FIELDS = {f.name for f in fields(HardwareProfile)} - {"path"}
_CACHE: dict[str, HardwareProfile] = {}
_PATHS: dict[tuple, str] = {}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


@functools.lru_cache(maxsize=None)
def cpu_model_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one; read once per process)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's ``flags``, or ``Features`` on Arm); empty where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""CPU flags of a bf16 matrix multiply in hardware (AVX-512 BF16, AMX, Arm's BF16 extension). Without one, CPU bf16
matmuls are emulated: the tiny model's training step took 17x longer in bf16 than in fp32 on an AVX2 EPYC."""


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bf16 in hardware: a GPU that supports it (assumed of a GPU this process does not
    see, as when planning for one), or a CPU with one of ``NATIVE_BF16_FLAGS``."""
    device = torch.device(device)
    if device.type == "cuda":
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & NATIVE_BF16_FLAGS)


def compute_dtype(choice: str, device: torch.device | str) -> str:
    """``train.dtype`` or ``optim.muon_ns_dtype`` on ``device``: "auto" is "bfloat16" where the device multiplies it
    in hardware (``native_bf16``), else "float32"; any other choice as it is."""
    if choice != "auto":
        return choice
    return "bfloat16" if native_bf16(device) else "float32"


def device_name(device: torch.device | str) -> str:
    """A human-readable name of ``device``: the GPU's name, or the CPU model with torch's thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{cpu_model_name()}, {torch.get_num_threads()} threads"
    return device.type


def device_key(device: torch.device | str) -> str:
    """A file-name-safe key for ``device``'s profile: ``cpu-<model>-<threads>t`` or ``<type>-<name>``."""
    device = torch.device(device)
    if device.type == "cpu":
        return f"cpu-{_slug(cpu_model_name())}-{torch.get_num_threads()}t"
    if device.type == "cuda":
        return f"cuda-{_slug(torch.cuda.get_device_name(device))}"
    return _slug(device.type)


def profile_path(device: torch.device | str, cache_dir: str | Path | None = None) -> Path:
    """Where ``device``'s profile is read from and written to."""
    env = os.environ.get(PROFILE_ENV)
    if env:
        return Path(env).expanduser()
    return cache_root(cache_dir) / "hardware" / f"{device_key(device)}.json"


def read_profile(path: str | Path) -> HardwareProfile:
    """Parse one profile file; every problem is a ConfigError naming the file, the key and the fix."""
    path = Path(path)
    fix = f"delete {path} or rerun `zaya tune gemm` / `zaya tune comm` to rewrite it"
    try:
        data = read_json(path)
    except ValueError as err:  # not JSON, not UTF-8, or nested past the parser's depth
        raise ConfigError(f"{path}: not valid JSON ({err}); {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a hardware profile is a JSON object; {fix}")
    if data.get("version") != PROFILE_VERSION:
        raise ConfigError(f"{path}: profile version {data.get('version')!r}, this zaya reads version "
                          f"{PROFILE_VERSION}; {fix}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; {fix}")
    defaults = HardwareProfile()
    for name, value in data.items():
        expected = type(getattr(defaults, name))
        ok = isinstance(value, expected) or (expected is float and isinstance(value, int))
        if not ok or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{path}: key {name!r} must be {expected.__name__}, got {value!r}; {fix}")
        if expected in (int, float) and value <= 0:
            raise ConfigError(f"{path}: key {name!r} must be positive, got {value!r}; {fix}")
    for dtype, value in data.get("peak_flops", {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{path}: peak_flops[{dtype!r}] must be a positive number of FLOP/s, got {value!r}; "
                              f"{fix}")
    profile = HardwareProfile(**data)
    profile.path = str(path)
    return profile


def load_profile(device: torch.device | str = "cpu", cache_dir: str | Path | None = None,
                 refresh: bool = False) -> HardwareProfile:
    """``device``'s profile: the file written by ``zaya tune`` if there is one, else the defaults (read once per
    process and device; ``refresh`` rereads). ``$ZAYA_HARDWARE_PROFILE`` names a file that must exist."""
    # Hot callers (Newton-Schulz's per-matrix plan, the loss) ask often: memoise the path by what it depends on.
    env = os.environ
    where = (str(device), str(cache_dir or ""), env.get(PROFILE_ENV), env.get("ZAYA_CACHE_DIR"), env.get("HOME"),
             torch.get_num_threads())
    key = _PATHS.get(where)
    if key is None:
        key = _PATHS[where] = str(profile_path(device, cache_dir))
    if not refresh and key in _CACHE:
        return _CACHE[key]
    path = Path(key)
    if path.is_file():
        profile = read_profile(path)
    elif os.environ.get(PROFILE_ENV):
        raise ConfigError(f"${PROFILE_ENV}={path}: no such file; unset it or write one with `zaya tune gemm`")
    else:
        profile = default_profile(device)
    _CACHE[key] = profile
    return profile


def clear_cache() -> None:
    """Forget the profiles read so far (the next ``load_profile`` of each device reads its file again)."""
    _CACHE.clear()
    _PATHS.clear()


def save_profile(profile: HardwareProfile, device: torch.device | str = "cpu",
                 cache_dir: str | Path | None = None) -> Path:
    """Write ``profile`` atomically to ``device``'s profile path (filling in the device key and name)."""
    profile.device_key = profile.device_key or device_key(device)
    profile.device_name = profile.device_name or device_name(device)
    path = profile_path(device, cache_dir)
    atomic_write_text(path, profile.to_json())
    profile.path = str(path)
    _CACHE[str(path)] = profile
    return path


def update_profile(device: torch.device | str, cache_dir: str | Path | None = None, **values: Any) -> Path:
    """Read ``device``'s profile (or the defaults), set ``values`` and write it back: each tune command updates
    only its own fields, so ``tune gemm`` and ``tune comm`` can be run in either order."""
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown hardware profile field(s): {', '.join(unknown)}")
    current = load_profile(device, cache_dir, refresh=True)
    data = asdict(current)
    data.pop("path")
    data.update(values)
    return save_profile(HardwareProfile(**data), device, cache_dir)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 1024,
                        seconds: float = 0.5) -> float:
    """FLOP/s of a square ``dtype`` matmul on ``device``, the best of a few timed windows (our 'peak')."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    flops = 2 * size**3
    best = 0.0
    deadline = time.perf_counter() + seconds
    torch.mm(a, b)
    while time.perf_counter() < deadline or best == 0.0:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        synchronize(device)
        best = max(best, 4 * flops / (time.perf_counter() - start))
    return best


def device_peak_flops(device: torch.device, configured: float = 0.0,
                      dtype: torch.dtype | str = torch.bfloat16) -> tuple[float, str]:
    """(peak FLOP/s, where it came from), for training in ``dtype``: the config's ``train.peak_flops``, else the
    peak ``zaya tune gemm`` measured for ``dtype`` (the device's hardware profile), else a known GPU's datasheet
    (dense bf16), else a quick measurement."""
    if configured > 0:
        return configured, "train.peak_flops"
    dtype = to_dtype(dtype)
    name = dtype_name(dtype)
    profile = load_profile(device)
    if profile.peak_flops.get(name, 0) > 0:
        return float(profile.peak_flops[name]), f"measured {name} peak, hardware profile {profile.path}"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        for key, peak in DATASHEET_PEAK_FLOPS.items():
            if key in gpu:
                return peak, f"{gpu} datasheet (dense bf16)"
    return measure_matmul_peak(device, dtype), f"measured {short_name(dtype)} matmul on {device.type}"
