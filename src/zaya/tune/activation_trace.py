"""Activation memory of one training micro-batch, measured by running the model's own code on fake tensors.

A hand-written formula for the tensors autograd keeps goes stale with every change to the model (a new norm, a
saved mask, a fused kernel); tracing does not. ``trace_micro_batch`` builds the model under torch's
``FakeTensorMode`` (shapes, dtypes and devices, no memory), runs the forward, the loss and the backward of one
micro-batch exactly as the trainer does (autocast around both, activation checkpointing), and counts live storage with
``LiveMemory``: the bytes alive at the end of the forward (what autograd saved, the logits, the autocast copies of
the weights) and the peak over forward and backward (adding the loss's and the backward's temporaries). Parameters
exist before the count starts and each gradient leaves it once accumulated: the planner adds the weights and
gradient buffers per parallel mode.

It costs seconds, not memory, for any model size, so ``zaya plan`` traces the real widths, vocabulary and sequence
length. To keep it quick at depth it traces one and two layers at one and two sequences and extrapolates linearly in
layers and sequences (``ActivationModel``); the tests check that against full traces and against real runs.

Two stand-ins, both shape-exact: ``F.grouped_mm``'s fake kernel accepts bf16 only, so fp32 traces call
``zaya::grouped_mm``, whose fake kernel gives the result's shape (the CPU's real kernel takes fp32); and the trace
runs on the CPU's autocast policy, which casts the same matmuls to bf16 as CUDA's, with the experts' GEMMs in
autocast's dtype as on a GPU (a CPU keeps them in fp32: ``zaya.model.moe.CPU_EXPERTS_IN_WEIGHT_DTYPE``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from zaya.config import ModelConfig
from zaya.tune.live_memory import LiveMemory


@dataclass(frozen=True)
class Trace:
    """Bytes of one traced micro-batch, beyond the parameters and their gradient buffers."""

    saved: int
    """Alive at the end of the forward: what the backward needs."""
    forward_peak: int
    """The most alive at once during the forward and the loss."""
    head_peak: int
    """... during the backward of the loss, the head and the final norm (until the last block's backward starts)."""
    blocks_peak: int
    """... during the blocks' backward."""

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.head_peak, self.blocks_peak)


def _shape_only_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, **_) -> torch.Tensor:
    """``F.grouped_mm`` through ``zaya::grouped_mm``, whose fake kernel gives the result's shape and dtype (and a
    trace still sees one grouped GEMM)."""
    from zaya.model import moe  # noqa: F401  (registers the op)

    return torch.ops.zaya.grouped_mm(a, b, offs)


@contextlib.contextmanager
def _grouped_mm_for(dtype: torch.dtype) -> Iterator[None]:
    if dtype == torch.bfloat16 or not hasattr(F, "grouped_mm"):
        yield
        return
    real = F.grouped_mm
    F.grouped_mm = _shape_only_grouped_mm
    try:
        yield
    finally:
        F.grouped_mm = real


@contextlib.contextmanager
def _experts_as_on_a_gpu() -> Iterator[None]:
    from zaya.model import moe

    saved = moe.CPU_EXPERTS_IN_WEIGHT_DTYPE
    moe.CPU_EXPERTS_IN_WEIGHT_DTYPE = False
    try:
        yield
    finally:
        moe.CPU_EXPERTS_IN_WEIGHT_DTYPE = saved


# The fused loss runs a Python loop over row chunks; a trace takes at most this many (bigger chunks, see below).
TRACE_MAX_CHUNKS = 64


@contextlib.contextmanager
def _loss_chunks(tokens: int, vocab: int, max_chunks: int | None) -> Iterator[None]:
    """Trace the loss with at most ``max_chunks`` chunks (None: the real ones). Its temporaries are a few fp32
    buffers of one chunk, so a bigger chunk over-states the peak by a few times (trace chunk - real chunk) x 4 bytes:
    at TRACE_MAX_CHUNKS at most about tokens x vocab / 8 bytes, under 0.2 % of any peak that includes the tokens'
    logits (tokens x vocab x 2 or 4)."""
    from zaya.model import loss
    from zaya.core.hardware import load_profile

    real = loss.CHUNK_ELEMENTS or load_profile(torch.device("cpu")).loss_chunk_elements
    saved = loss.CHUNK_ELEMENTS
    loss.CHUNK_ELEMENTS = real if max_chunks is None else max(real, math.ceil(tokens * vocab / max_chunks))
    try:
        yield
    finally:
        loss.CHUNK_ELEMENTS = saved


@contextlib.contextmanager
def fake_model(cfg: ModelConfig, tokens: int, *, dtype: str = "bfloat16", activation_checkpointing: bool = False,
               param_dtype: str = "float32", max_loss_chunks: int | None = TRACE_MAX_CHUNKS) -> Iterator[nn.Module]:
    """``cfg``'s ``ZayaForCausalLM`` built under ``FakeTensorMode`` (on while the block runs) with the stand-ins
    above, for a micro-batch of ``tokens`` tokens: the one setup of every trace of a training step (this module's
    memory, ``zaya.tune.cost``'s kernels). ``max_loss_chunks``: None traces the loss's real row chunks."""
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    with FakeTensorMode(), _grouped_mm_for(compute), _experts_as_on_a_gpu(), \
            _loss_chunks(tokens, cfg.vocab_size, max_loss_chunks):
        from zaya.model import ZayaForCausalLM

        model = ZayaForCausalLM(cfg)
        model.activation_checkpointing = activation_checkpointing
        if param_dtype == "bfloat16":
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        yield model


def trace_micro_batch(cfg: ModelConfig, batch: int, seq_len: int, *, dtype: str = "bfloat16",
                      activation_checkpointing: bool = False, param_dtype: str = "float32") -> Trace:
    """Trace forward + loss + backward of ``batch`` sequences of ``seq_len`` tokens through ``cfg``.

    dtype: the autocast compute dtype ("bfloat16" or "float32"). param_dtype: the parameters' dtype during compute
    ("float32": DDP and ZeRO-1, whose autocast copies each weight to bf16 and keeps the copy for the backward;
    "bfloat16": FSDP2's mixed precision, which all-gathers bf16 weights, so autocast makes no copy).
    """
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    with fake_model(cfg, batch * seq_len, dtype=dtype, activation_checkpointing=activation_checkpointing,
                    param_dtype=param_dtype) as model:
        params = [p for p in model.parameters() if p.requires_grad]
        # Each gradient lives from its computation until it is accumulated, then leaves the count: DDP copies it
        # into its bucket (allocated for good, counted by the planner), FSDP2 reduce-scatters it (the planner adds
        # one block's unsharded gradients).
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        ids = torch.randint(3, cfg.vocab_size, (batch, seq_len))
        with LiveMemory("cpu") as mem:
            peaks: list[int] = []

            def blocks_begin(_grad: torch.Tensor) -> None:
                if len(peaks) == 1:  # the first gradient to reach the last block's output
                    peaks.append(mem.peak)
                    mem.reset_peak()

            def hook_outputs(_module, _inputs, output) -> None:
                for t in output if isinstance(output, tuple) else (output,):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(blocks_begin)

            handle = model.blocks[-1].register_forward_hook(hook_outputs)
            # The backward runs inside the autocast region, as the trainer's does: autocast keeps its bf16 copies
            # of the weights cached until the region ends, so they stay alive through the backward even where
            # autograd does not save them (activation checkpointing).
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == torch.bfloat16):
                try:
                    out = model(ids, labels=ids)
                    loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
                    del out
                finally:
                    handle.remove()
                saved = mem.current
                peaks.append(mem.peak)
                mem.reset_peak()
                loss.backward()
                del loss
                peaks.append(mem.peak)
        forward_peak, head_peak, blocks_peak = peaks if len(peaks) == 3 else (*peaks, 0)
        return Trace(saved=saved, forward_peak=forward_peak, head_peak=head_peak, blocks_peak=blocks_peak)

@dataclass(frozen=True)
class ActivationModel:
    """Activation memory of a micro-batch as a function of depth and tokens.

    Each quantity (the saved bytes and the peak of each phase: forward, head backward, blocks backward) is taken
    as ``fixed + per_token * tokens + layers * (per_layer + per_layer_token * tokens)``, fitted exactly to four
    traces (1 and 2 layers, 1 and 2 sequences); the micro-batch's peak is the largest phase's. One line per phase,
    not one for the peak: which phase peaks changes with the token count (few tokens: a layer's weight gradients;
    many: the saved activations plus the loss's gradient).
    """

    coefficients: dict[str, tuple[float, float, float, float]]
    """"saved", "forward_peak", "head_peak", "blocks_peak" -> (fixed, per_token, per_layer, per_layer_token)."""
    trace_seq_len: int
    """Tokens per traced sequence."""

    def _at(self, key: str, layers: int, tokens: int) -> int:
        fixed, per_token, per_layer, per_layer_token = self.coefficients[key]
        return round(fixed + per_token * tokens + layers * (per_layer + per_layer_token * tokens))

    def saved_bytes(self, layers: int, tokens: int) -> int:
        return self._at("saved", layers, tokens)

    def phase_peaks(self, layers: int, tokens: int) -> dict[str, int]:
        return {k: self._at(k, layers, tokens) for k in ("forward_peak", "head_peak", "blocks_peak")}

    def peak_bytes(self, layers: int, tokens: int) -> int:
        return max(self.phase_peaks(layers, tokens).values())


def activation_model(cfg: ModelConfig, seq_len: int, *, dtype: str = "bfloat16", activation_checkpointing: bool = False,
                     param_dtype: str = "float32") -> ActivationModel:
    """Fit ``ActivationModel`` from traces of one and two layers at one and two sequences of ``seq_len`` tokens (a
    sequence per rank: under context parallelism, seq_len / cp).

    At the real sequence length, not a shorter one scaled up: which allocations meet at a phase's peak changes with
    the token count (at a few hundred tokens the head's backward peaks at its fp32 weight gradient, at thousands at
    the logits' gradient), so a line through short traces can miss the real peak by a third (ZAYA1-base: 4.5 GiB
    from 512-token traces against 6.4 GiB traced at 4,096). Beyond two sequences the line is extrapolated: there the
    token-proportional parts already dominate."""
    t = seq_len
    kwargs = dict(dtype=dtype, activation_checkpointing=activation_checkpointing, param_dtype=param_dtype)
    traces = {(layers, b): trace_micro_batch(dataclasses.replace(cfg, num_layers=layers), b, t, **kwargs)
              for layers in (1, 2) for b in (1, 2)}

    def fit(key: str) -> tuple[float, float, float, float]:
        v = {k: getattr(tr, key) for k, tr in traces.items()}
        per_layer_token = ((v[2, 2] - v[1, 2]) - (v[2, 1] - v[1, 1])) / t
        per_layer = (v[2, 1] - v[1, 1]) - per_layer_token * t
        per_token = (v[1, 2] - v[1, 1]) / t - per_layer_token
        fixed = v[1, 1] - per_token * t - per_layer - per_layer_token * t
        return fixed, per_token, per_layer, per_layer_token

    keys = ("saved", "forward_peak", "head_peak", "blocks_peak")
    return ActivationModel(coefficients={k: fit(k) for k in keys}, trace_seq_len=t)
