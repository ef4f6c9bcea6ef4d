"""A device cost model of the training step: the traced kernels (``zaya.tune.kernel_trace``) priced on a device.

Two clocks, the host's and the device's. Every op the step dispatches costs the host time: one that launches a
kernel ``launch_s`` (Python, dispatcher, launch), one that launches none ``host_op_s`` (views, allocations,
metadata). A kernel runs on the device for ``max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency))``,
starting when the host has issued it and the device has finished the previous one: on a GPU the host runs ahead of
a busy device and its time hides, and a device waiting on a host that issues small kernels is host-bound; a host
read (``.item()``) makes the host wait for the device. On a CPU (``asynchronous`` False) the two add up. The step
is the later clock; each kernel is charged what it adds to it. The compiled variant (``train.compile``: each block
compiled) fuses every run of non-GEMM kernels of one block's forward or backward between two GEMMs / attention
kernels into one kernel: the tensors made and consumed inside the run are never written, the graph launches it
once, and the ops that launch nothing cost the host nothing.

GEMM efficiency by shape: a large GEMM reaches ``gemm_efficiency`` of the peak. On a GPU a smaller one loses to
wave quantisation (its output tiles, ``tile``, spread over the compute units: a last, partial wave idles the rest;
a grouped GEMM's tiles counted per group, at its rows per group), and a skinny one is bound by its bytes (the
memory roofline); a grouped (MoE expert) GEMM reaches a lower share than a plain one (``grouped_gemm_efficiency``).
On a CPU the profile carries the measured rates of square GEMMs by size (``gemm_curve``, operands in cache): a GEMM
runs at that of the square one of its FLOPs (per group for a grouped one), after streaming its operands and result
from and to memory (``gemm_loads_overlap`` False: in a step the kernels between evict them). A row-wise kernel
(softmax: one thread block per row on a GPU) with fewer rows than compute units leaves the rest idle, the busy ones
drawing only their share of the bandwidth.

Device numbers (``DEVICES``) are the vendors' datasheet peaks; the efficiencies and host costs are stated figures
from published measurements of other software, not fitted to zaya's figures (``benchmarks/cost_model.py`` validates
the model against every recorded figure, and says where and why it misses).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from zaya.tune.kernel_trace import ATTENTION, GEMM, GROUPED_GEMMS, Kernel


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
    grouped_gemm_efficiency: float
    """Share of the peak a large grouped (MoE expert) GEMM reaches, its tiles filling every wave."""
    attention_efficiency: float
    """Share of the peak a flash-attention kernel reaches (forward and backward alike)."""
    bandwidth_efficiency: float
    """Share of the bandwidth a streaming kernel reaches."""
    launch_s: float
    """Host time to issue one eager op that launches a kernel (Python, dispatcher, launch)."""
    host_op_s: float
    """Host time to issue one eager op that launches none (a view, an allocation, metadata)."""
    asynchronous: bool = True
    """The host issues ahead of the device (a GPU stream); False: each op runs in the issuing thread (a CPU)."""
    compute_units: int = 1
    """SMs / CUs (the wave model); 1 = no wave model (a CPU)."""
    tile: tuple[int, int] = (128, 256)
    gemm_loads_overlap: bool = True
    """A GEMM's operand loads overlap its compute (a GPU's pipelined loads: the roofline's max). False (a CPU): the
    GEMM rates are measured with operands in cache, and in a step each GEMM first streams its operands and result
    from and to memory (the kernels between evicted them), so bytes / bandwidth adds to the compute time."""
    gemm_curve: tuple[tuple[float, float], ...] = ()
    """(FLOPs, rate / peak) of square GEMMs by size, measured (a CPU; above 1 where a mid-size GEMM, its operands
    in cache, beats the 1024^3 one of the peak); empty = the wave model."""
    source: str = ""


# Datasheets: NVIDIA H100 SXM5 and H200 SXM (989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 132 SMs; HBM3 3.35 TB/s, HBM3e
# 4.8 TB/s); AMD Instinct MI300X (1,307 TFLOP/s dense bf16, 163 TFLOP/s fp32 matrix, 304 CUs, 5.3 TB/s). Efficiencies,
# assumed from published measurements (not zaya's): cuBLAS bf16 GEMMs of thousands on a side reach about 75 % of the
# H100's dense peak, hipBLASLt about 45 % of the MI300X's (SemiAnalysis's MI300X vs H100 training study, 2024);
# CUTLASS's SM90 grouped GEMM (the kernel family torch's grouped_mm runs on Hopper; this figure is another build of
# it) about 16 % of the H100's dense peak at an MoE shape with full waves (160.5 TFLOP/s: 128 experts x 512 rows, K
# 2048, N 1536, bf16, the cooperative schedule; cuBLAS expert by expert 129.5; tgale96/grouped_gemm PR 37, 2026), no
# published figure for the MI300X's grouped GEMM (taken as its dense GEMMs'); torch's flash-attention kernels
# (FlashAttention-2) about 35 % of Hopper's peak (FlashAttention-3 paper, 2024), assumed the same for the MI300X's CK
# kernels; streaming kernels 90 % of HBM bandwidth on Hopper, 80 % on the MI300X. Host costs of eager PyTorch on a
# server CPU, from the published breakdown of one op's path (Python bytecode ~1 us, pybind11 ~1 us, autograd recording
# 1-3 us, ATen dispatcher 1-2 us, cudaLaunchKernel 1-3 us; "From PyTorch op to kernel launch", jiahuanglin.xyz GPU
# kernel lessons, lesson 18): an op that launches a kernel 5 us (the sum's lower end), one that launches none 1 us (a
# dispatcher round: most are issued from C++, by composite ops and the autograd engine, not from Python);
# hipLaunchKernel taken alike.
_HOST = dict(launch_s=5e-6, host_op_s=1e-6)
_HOPPER = dict(gemm_efficiency=0.75, grouped_gemm_efficiency=0.16, attention_efficiency=0.35, bandwidth_efficiency=0.9,
               compute_units=132, **_HOST)
DEVICES: dict[str, Device] = {
    "h100": Device("NVIDIA H100 SXM", {"bfloat16": 989e12, "float32": 67e12}, 3.35e12, **_HOPPER,
                   source="NVIDIA H100 datasheet"),
    "h200": Device("NVIDIA H200 SXM", {"bfloat16": 989e12, "float32": 67e12}, 4.8e12, **_HOPPER,
                   source="NVIDIA H200 datasheet"),
    "mi300x": Device("AMD Instinct MI300X", {"bfloat16": 1307e12, "float32": 163e12}, 5.3e12, gemm_efficiency=0.45,
                     grouped_gemm_efficiency=0.45, attention_efficiency=0.35, bandwidth_efficiency=0.8,
                     compute_units=304, **_HOST,
                     source="AMD MI300X datasheet"),
}


CPU_GEMM_SIZES = (32, 64, 128, 256, 512, 1024)
"""Square GEMM sides whose rates the CPU profile measures (``gemm_curve``; 1024 is the peak)."""


def cpu_clock():
    """The clock CPU timings use: this thread's CPU time at one intra-op thread (on a shared machine the time the
    scheduler gave other processes is not the step's work, and a step and a microbenchmark get different shares
    of it), the wall clock with more threads."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def measure_cpu(threads: int | None = None, seconds: float = 0.3) -> Device:
    """This CPU, measured with microbenchmarks (never with the step it predicts), on ``cpu_clock``: the rates of
    square fp32 matmuls of 32 to 1024 a side (``gemm_curve``, relative to the 1024^3 one, the peak; each in windows
    of the same work, their host cost taken off), the bf16 peak where the CPU has native bf16, a 64 MiB copy's
    bandwidth, SDPA's rate at a head dim of 64 relative to the GEMM, and the host cost of an op: a loop of small
    adds (``launch_s``) and of views (``host_op_s``)."""
    from zaya.core.hardware import native_bf16

    if threads:
        torch.set_num_threads(threads)
    clock = cpu_clock()
    one = torch.ones(8)
    launch = _best(lambda: _loop(lambda: one.add(one)), seconds, clock) / _LOOP
    view = _best(lambda: _loop(lambda: one.view(2, 4)), seconds, clock) / _LOOP
    rates = {n: _gemm_rate(n, torch.float32, seconds / 2, clock, launch) for n in CPU_GEMM_SIZES}
    peaks = {"float32": rates[1024]}
    peaks["bfloat16"] = _gemm_rate(1024, torch.bfloat16, seconds, clock, launch) if native_bf16(torch.device("cpu")) \
        else peaks["float32"] / 8  # emulated bf16: not used by an fp32 step, kept only so every dtype has a figure
    src = torch.empty(16 << 20)
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), seconds, clock)
    q = torch.randn(4, 4, 512, 64)
    attn = _best(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), seconds, clock)
    attn_rate = 0.5 * 4 * 4 * 512 * 512 * 64 * 4 / attn
    name = f"this CPU ({torch.get_num_threads()} threads)"
    return Device(name, peaks, 2 * src.numel() * 4 / copy, gemm_efficiency=1.0, grouped_gemm_efficiency=1.0,
                  attention_efficiency=min(1.0, attn_rate / peaks["float32"]), bandwidth_efficiency=1.0,
                  launch_s=launch, host_op_s=view, asynchronous=False, gemm_loads_overlap=False,
                  gemm_curve=tuple((2.0 * n ** 3, r / peaks["float32"]) for n, r in rates.items()),
                  source="measured here: matmuls by size, copy, SDPA, small ops and views")


_LOOP = 100


def _loop(fn) -> None:
    for _ in range(_LOOP):
        fn()


def _gemm_rate(n: int, dtype: torch.dtype, seconds: float, clock, launch: float) -> float:
    """FLOP/s of an n^3 matmul: the best window of (1024 / n)^3 calls (the work of one 1024^3 call, so that every
    size is timed over windows as long), each call's host cost ``launch`` taken off."""
    x = torch.randn(n, n).to(dtype)
    calls = (1024 // n) ** 3

    def window() -> None:
        for _ in range(calls):
            torch.mm(x, x)
    return 2.0 * n ** 3 * calls / max(_best(window, seconds, clock) - calls * launch, 1e-12)


def _best(fn, seconds: float, clock=time.perf_counter) -> float:
    """The least time of ``fn`` on ``clock`` over calls for ``seconds`` of wall time (at least one)."""
    fn()
    best = math.inf
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == math.inf:
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def wave_efficiency(kernel: Kernel, device: Device) -> float:
    """The share of its waves a GEMM's output tiles fill: (groups x tiles per group) over the compute units, a last
    partial wave idling the rest; 1 where the device has no wave model."""
    groups, m, n = kernel.tiles
    if device.compute_units <= 1 or not m or not n:
        return 1.0
    tiles = max(1, groups) * math.ceil(m / device.tile[0]) * math.ceil(n / device.tile[1])
    return tiles / (math.ceil(tiles / device.compute_units) * device.compute_units)


def curve_efficiency(flops: float, curve: tuple[tuple[float, float], ...]) -> float:
    """The efficiency of a GEMM of ``flops`` from measured (FLOPs, efficiency) points: interpolated in log FLOPs,
    the end points' beyond them."""
    if flops <= curve[0][0]:
        return curve[0][1]
    for (f0, e0), (f1, e1) in zip(curve, curve[1:]):
        if flops <= f1:
            w = math.log(flops / f0) / math.log(f1 / f0)
            return e0 + w * (e1 - e0)
    return curve[-1][1]


def gemm_efficiency(kernel: Kernel, device: Device) -> float:
    """A GEMM's share of the peak by its shape: the measured curve at its FLOPs per group where the device has one,
    else the large (grouped or plain) GEMM's efficiency times the wave quantisation."""
    if device.gemm_curve:
        return curve_efficiency(kernel.flops / max(1, kernel.tiles[0]), device.gemm_curve)
    large = device.grouped_gemm_efficiency if kernel.op in GROUPED_GEMMS else device.gemm_efficiency
    return large * wave_efficiency(kernel, device)


def kernel_seconds(kernel: Kernel, device: Device, nbytes: int | None = None) -> float:
    """One kernel's time on the device, compute- or memory-bound (``nbytes`` overrides its bytes: a fused
    kernel's); a GEMM on a device whose loads do not overlap its compute (``gemm_loads_overlap``) both."""
    peak = device.peak_flops.get(kernel.dtype, device.peak_flops["float32"])
    compute = 0.0
    if kernel.kind == GEMM:
        compute = kernel.flops / (peak * gemm_efficiency(kernel, device))
    elif kernel.kind == ATTENTION:
        compute = kernel.flops / (peak * device.attention_efficiency)
    memory = (kernel.bytes if nbytes is None else nbytes) / (device.bandwidth * device.bandwidth_efficiency)
    if kernel.kind == GEMM and not device.gemm_loads_overlap:
        return compute + memory
    return max(compute, memory / row_occupancy(kernel, device))


def row_occupancy(kernel: Kernel, device: Device) -> float:
    """The share of the compute units a row-wise kernel keeps busy (one block per row): fewer rows than units
    leave the rest idle, and each busy unit draws its fair share of the bandwidth (its lower bound: a unit alone
    may draw more, so this errs slow); 1 for other kernels and on a CPU."""
    if not kernel.rows or device.compute_units <= 1:
        return 1.0
    return min(1.0, kernel.rows / device.compute_units)


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
    host_seconds: float = 0.0
    """The host's busy time issuing the step (hidden where the device is busier)."""
    by_phase: dict[str, float] = field(default_factory=dict)
    by_kind: dict[str, float] = field(default_factory=dict)
    by_part: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    """Seconds spent compute-, memory- and host-bound."""

    def top(self, table: str, n: int = 5) -> list[tuple[str, float]]:
        rows = sorted(getattr(self, table).items(), key=lambda kv: -kv[1])
        return rows[:n]


def timeline(issues: list[tuple[float, float, bool]], asynchronous: bool) -> list[tuple[float, float]]:
    """Each op's share of a stream's time: ``issues`` are (host seconds, device seconds, whether the host first
    waits for the device) in issue order. Asynchronous: the host issues op i at its clock ``h`` (after the last
    op's issue; after the device's clock ``d`` on a wait), the device runs it from max(h, d). Else host and
    device time add. Returns, per op, what it adds to max(h, d), and how much of that is its device time (the rest
    is the host's: issuing, or waiting to issue)."""
    h = d = 0.0
    out = []
    for host, dev, wait in issues:
        end = max(h, d)
        if not asynchronous:
            h = d = h + host + dev
        else:
            h = max(h, d) + host if wait else h + host
            d = max(h, d) + dev
        added = max(h, d) - end
        out.append((added, min(added, dev)))
    return out


def predict(kernels: list[Kernel], device: Device, compiled: bool = False,
            eager_parts: tuple[str, ...] = EAGER_PARTS) -> Prediction:
    """The predicted step time of ``kernels`` on ``device``, eager or compiled (``fuse``; ``eager_parts``: what
    compilation leaves out)."""
    groups = fuse(kernels, eager_parts) if compiled else [([k], k.bytes) for k in kernels]
    pred = Prediction(device.name, compiled, 0.0, len(groups), sum(k.flops for k in kernels))
    issues, leads = [], []
    for run, nbytes in groups:
        lead = next((k for k in run if k.kind != "other"), run[0])
        graph = compiled and lead.phase in ("forward", "backward") and lead.part not in eager_parts
        host = device.launch_s if graph else sum(device.launch_s + k.host_ops * device.host_op_s for k in run)
        if len(run) > 1:  # a fused kernel: the compiler picks its own split, not the row-wise one of its lead
            lead = dataclasses.replace(lead, rows=0)
        dev = kernel_seconds(lead, device, nbytes if lead.kind == "other" else None)
        issues.append((host, dev, any(k.sync for k in run)))
        leads.append((run, lead, nbytes, dev))
    sums = {name: defaultdict(float) for name in ("by_phase", "by_kind", "by_part", "bound")}
    for (t, on_device), (run, lead, nbytes, dev) in zip(timeline(issues, device.asynchronous), leads):
        pred.seconds += t
        kind = lead.kind if lead.kind != "other" else ("fused" if len(run) > 1 else _kind_of(lead))
        sums["by_phase"][lead.phase] += t
        sums["by_kind"][kind] += t
        sums["by_part"][lead.part] += t
        mem = nbytes / (device.bandwidth * device.bandwidth_efficiency) / row_occupancy(lead, device)
        sums["bound"]["host"] += t - on_device
        sums["bound"]["memory" if mem >= dev else "compute"] += on_device
    pred.host_seconds = sum(h for h, _, _ in issues)
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
