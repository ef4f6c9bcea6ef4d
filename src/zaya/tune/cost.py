"""A device cost model of the training step: the traced kernels (``zaya.tune.kernel_trace``) priced on a device.

Each kernel takes ``max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency), launch)``: compute-bound,
memory-bound, or bound by the host issuing it (an eager PyTorch op costs the host a few microseconds of dispatch
and launch; while kernels run longer than that the host runs ahead and the cost hides, while they run shorter the
device waits). The step is the sum. Not modelled: the host time of ops that launch nothing (views, Python between
ops) and host reads. The compiled variant (``train.compile``: each block compiled) fuses every run of
non-GEMM kernels of one block's forward or backward between two GEMMs / attention kernels into one kernel: the
tensors made and consumed inside the run are never written, and it is launched once.

Device numbers (``DEVICES``) are the vendors' datasheet peaks; the efficiencies are stated assumptions from
published measurements of other software, not fitted to zaya's figures (``benchmarks/cost_model.py`` validates the
model against every recorded figure, and says where and why it misses). GEMM efficiency by shape: a large GEMM
reaches ``gemm_efficiency`` of the peak; a small one loses to wave quantisation (output tiles of 128 x 256 spread
over the device's compute units: a last, partial wave idles the rest).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from zaya.tune.kernel_trace import ATTENTION, GEMM, Kernel


@dataclass(frozen=True)
class Device:
    """What the model knows of a device. FLOP/s and bytes/s are peaks; the efficiencies are fractions of them."""

    name: str
    peak_flops: dict[str, float]
    """Dense matmul peak by dtype name ("bfloat16", "float32": fp32 without TF32, torch's default for matmuls)."""
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    gemm_efficiency: float
    """Share of the peak a large GEMM reaches."""
    attention_efficiency: float
    """Share of the peak a flash-attention kernel reaches (forward and backward alike)."""
    bandwidth_efficiency: float
    """Share of the bandwidth a streaming kernel reaches."""
    launch_s: float
    """Host time to issue one eager op (dispatch + launch): the least time an eager kernel takes in a stream."""
    compute_units: int = 1
    """SMs / CUs (the wave model); 1 = no wave model (a CPU)."""
    tile: tuple[int, int] = (128, 256)
    source: str = ""


# Datasheets: NVIDIA H100 SXM5 and H200 SXM (989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 132 SMs; HBM3 3.35 TB/s,
# HBM3e 4.8 TB/s); AMD Instinct MI300X (1,307 TFLOP/s dense bf16, 163 TFLOP/s fp32 matrix, 304 CUs, 5.3 TB/s).
# Efficiencies, assumed from published measurements (not zaya's): cuBLAS bf16 GEMMs of thousands on a side reach
# about 75 % of the H100's dense peak, hipBLASLt about 45 % of the MI300X's (SemiAnalysis's MI300X vs H100 training
# study, 2024); torch's flash-attention kernels (FlashAttention-2) about 35 % of Hopper's peak (FlashAttention-3
# paper, 2024), assumed the same for the MI300X's CK kernels; streaming kernels 90 % of HBM bandwidth on Hopper,
# 80 % on the MI300X; an eager op costs the host 5 us (Python, dispatcher, cudaLaunchKernel / hipLaunchKernel).
_HOPPER = dict(gemm_efficiency=0.75, attention_efficiency=0.35, bandwidth_efficiency=0.9, launch_s=5e-6,
               compute_units=132)
DEVICES: dict[str, Device] = {
    "h100": Device("NVIDIA H100 SXM", {"bfloat16": 989e12, "float32": 67e12}, 3.35e12, **_HOPPER,
                   source="NVIDIA H100 datasheet"),
    "h200": Device("NVIDIA H200 SXM", {"bfloat16": 989e12, "float32": 67e12}, 4.8e12, **_HOPPER,
                   source="NVIDIA H200 datasheet"),
    "mi300x": Device("AMD Instinct MI300X", {"bfloat16": 1307e12, "float32": 163e12}, 5.3e12, gemm_efficiency=0.45,
                     attention_efficiency=0.35, bandwidth_efficiency=0.8, launch_s=5e-6, compute_units=304,
                     source="AMD MI300X datasheet"),
}


def measure_cpu(threads: int | None = None, seconds: float = 0.3) -> Device:
    """This CPU, measured with microbenchmarks (never with the step it predicts): the best fp32 (and bf16) rate of
    a 1024^3 matmul, a 64 MiB copy's bandwidth, SDPA's rate at a head dim of 64 relative to the GEMM, and one small
    op's wall time (the eager launch). The GEMM rate is the peak, so its efficiency is 1."""
    from zaya.core.hardware import measure_matmul_peak, native_bf16

    if threads:
        torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    peaks = {"float32": measure_matmul_peak(cpu, torch.float32, 1024, seconds)}
    peaks["bfloat16"] = measure_matmul_peak(cpu, torch.bfloat16, 1024, seconds) if native_bf16(cpu) else \
        peaks["float32"] / 8  # emulated bf16: not used by an fp32 step, kept only so every dtype has a figure
    src = torch.empty(16 << 20)
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), seconds)
    q = torch.randn(4, 4, 512, 64)
    attn = _best(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), seconds)
    attn_rate = 0.5 * 4 * 4 * 512 * 512 * 64 * 4 / attn
    one = torch.ones(8)
    launch = _best(lambda: one.add(one), seconds)
    name = f"this CPU ({torch.get_num_threads()} threads)"
    return Device(name, peaks, 2 * src.numel() * 4 / copy, gemm_efficiency=1.0,
                  attention_efficiency=min(1.0, attn_rate / peaks["float32"]), bandwidth_efficiency=1.0,
                  launch_s=launch, source="measured here: matmul, copy, SDPA and a small op")


def _best(fn, seconds: float) -> float:
    fn()
    best = math.inf
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == math.inf:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _wave_efficiency(kernel: Kernel, device: Device) -> float:
    groups, m, n = kernel.tiles
    if device.compute_units <= 1 or not m or not n:
        return 1.0
    tiles = max(1, groups) * math.ceil(m / device.tile[0]) * math.ceil(n / device.tile[1])
    return tiles / (math.ceil(tiles / device.compute_units) * device.compute_units)


def kernel_seconds(kernel: Kernel, device: Device, nbytes: int | None = None) -> float:
    """One kernel's predicted time (``nbytes`` overrides its bytes: a fused kernel's)."""
    peak = device.peak_flops.get(kernel.dtype, device.peak_flops["float32"])
    compute = 0.0
    if kernel.kind == GEMM:
        compute = kernel.flops / (peak * device.gemm_efficiency * _wave_efficiency(kernel, device))
    elif kernel.kind == ATTENTION:
        compute = kernel.flops / (peak * device.attention_efficiency)
    memory = (kernel.bytes if nbytes is None else nbytes) / (device.bandwidth * device.bandwidth_efficiency)
    return max(compute, memory, device.launch_s)


EAGER_PARTS = ("head and loss", "embedding")
"""What ``train.compile`` leaves eager: everything outside the blocks (the optimizer and clip are never fused)."""


def fuse(kernels: list[Kernel], eager_parts: tuple[str, ...] = EAGER_PARTS) -> list[tuple[list[Kernel], int]]:
    """Group ``kernels`` as a compiled block runs them: consecutive non-GEMM kernels of one phase of the forward or
    backward outside ``eager_parts`` become one kernel whose bytes are the tensors it reads from outside and the
    ones read after it (or never read: a result); everything else stays a kernel of its own. Returns (kernels,
    bytes) per launched kernel."""
    last_read: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for sid, _ in k.reads:
            last_read[sid] = i
    groups: list[tuple[list[Kernel], int]] = []
    i = 0
    while i < len(kernels):
        k = kernels[i]
        if k.kind != "other" or k.phase not in ("forward", "backward") or k.part in eager_parts:
            groups.append(([k], k.bytes))
            i += 1
            continue
        j = i
        while j < len(kernels) and kernels[j].kind == "other" and kernels[j].phase == k.phase and \
                kernels[j].part not in eager_parts:
            j += 1
        run = kernels[i:j]
        made: set[int] = set()
        nbytes = 0
        seen: set[int] = set()
        for x in run:
            for sid, b in x.reads:
                if sid not in made and sid not in seen:
                    nbytes += b
                    seen.add(sid)
            for sid, _ in x.writes:
                made.add(sid)
        for x in run:
            for sid, b in x.writes:
                if last_read.get(sid, j) >= j or last_read.get(sid) is None:
                    nbytes += b
        groups.append((run, nbytes))
        i = j
    return groups


@dataclass
class Prediction:
    """A step's predicted time on one device, and where it goes."""

    device: str
    compiled: bool
    seconds: float
    launches: int
    flops: float
    by_phase: dict[str, float] = field(default_factory=dict)
    by_kind: dict[str, float] = field(default_factory=dict)
    by_part: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    """Seconds spent compute-, memory- and launch-bound."""

    def top(self, table: str, n: int = 5) -> list[tuple[str, float]]:
        rows = sorted(getattr(self, table).items(), key=lambda kv: -kv[1])
        return rows[:n]


def predict(kernels: list[Kernel], device: Device, compiled: bool = False,
            eager_parts: tuple[str, ...] = EAGER_PARTS) -> Prediction:
    """The predicted step time of ``kernels`` on ``device``, eager or compiled (``fuse``; ``eager_parts``: what
    compilation leaves out)."""
    groups = fuse(kernels, eager_parts) if compiled else [([k], k.bytes) for k in kernels]
    pred = Prediction(device.name, compiled, 0.0, len(groups), sum(k.flops for k in kernels))
    sums = {name: defaultdict(float) for name in ("by_phase", "by_kind", "by_part", "bound")}
    for run, nbytes in groups:
        lead = next((k for k in run if k.kind != "other"), run[0])
        t = kernel_seconds(lead, device, nbytes if lead.kind == "other" else None)
        pred.seconds += t
        kind = lead.kind if lead.kind != "other" else ("fused" if len(run) > 1 else _kind_of(lead))
        sums["by_phase"][lead.phase] += t
        sums["by_kind"][kind] += t
        sums["by_part"][lead.part] += t
        mem = nbytes / (device.bandwidth * device.bandwidth_efficiency)
        sums["bound"]["memory" if mem >= t else ("compute" if t > device.launch_s else "launch")] += t
    for name, d in sums.items():
        setattr(pred, name, dict(d))
    return pred


def _kind_of(k: Kernel) -> str:
    if k.phase == "optimizer" or k.op.startswith("_foreach") or k.op.startswith("_fused"):
        return "optimizer elementwise"
    if k.op in ("sort", "argsort", "scatter_add", "index_add", "index_copy", "gather", "index_select", "embedding",
                "embedding_dense_backward", "index", "scatter"):
        return "gather/scatter"
    if k.op in ("sum", "mean", "amax", "max", "norm", "linalg_vector_norm", "_log_softmax", "_softmax", "cumsum",
                "log_softmax", "softmax"):
        return "reduction"
    if k.op in ("_to_copy", "copy_", "clone", "cat", "fill_", "zero_", "zeros", "ones", "full"):
        return "copy/fill"
    return "elementwise"


def mfu(cfg, tokens: int, seq_len: int, seconds: float, peak: float) -> float:
    """MFU by the repo's convention (``benchmarks/gpu_model_step.py``): 3 x forward matmul FLOPs per token at
    context seq_len / 2 (``zaya.model.info.forward_flops_per_token``) x tokens / seconds / the dense bf16 peak."""
    from zaya.model.info import forward_flops_per_token

    return 3 * sum(forward_flops_per_token(cfg, seq_len // 2).values()) * tokens / seconds / peak
