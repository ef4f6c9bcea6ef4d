"""Every kernel of one training step, traced on fake tensors: what the cost model (``zaya.tune.cost``) prices.

``KernelRecorder`` is a ``TorchDispatchMode`` that records each aten op the step dispatches as a ``Kernel``: its
FLOPs (matmul, bmm, grouped GEMM, convolution, attention: exact, from ``torch.utils.flop_counter`` where it has a
formula; every other op 0), the bytes it reads and writes (the sizes and dtypes of its tensor arguments and results),
the storages it reads and writes (so that a fused variant can drop the intermediates), the model part it runs in
(``ModuleTracker``: forward and backward) and the phase. Views, allocations and metadata ops launch no kernel and
are not recorded as kernels, but each costs the host a dispatch: a kernel carries the count of those dispatched since
the previous kernel (``host_ops``), and whether the host read a value back in between (``sync``: it waited for the
device), for the cost model's host-time model.

``trace_step`` runs one training step of the model's own code at real shapes under ``zaya.tune.activation_trace``'s
fake setup, as the trainer does it: forward with labels under autocast, backward, clip, Muon + AdamW, zero_grad.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

from zaya.config import ModelConfig, OptimConfig
from zaya.core.hardware import PROFILE_ENV, HardwareProfile

aten = torch.ops.aten

GEMM, ATTENTION, OTHER = "gemm", "attention", "other"
GROUPED_GEMMS = ("_grouped_mm", "grouped_mm")
"""The grouped (MoE expert) GEMM kernels: aten's and ``zaya::grouped_mm``."""
_PART = "zaya_part"

# Ops that make no kernel: allocation without initialisation, metadata, host reads (each a host dispatch).
_NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
              aten.new_empty_strided.default, aten.empty_like.default, aten.lift_fresh.default,
              aten._local_scalar_dense.default, aten.detach.default, aten.set_.source_Storage_storage_offset,
              aten.resize_.default}
# Ops that read only the rows they gather (their result's bytes, plus the indices), not the whole source.
_GATHERS = {aten.embedding.default, aten.index_select.default, aten.index.Tensor, aten.gather.default}

# Row-wise kernels: a GPU runs one thread block per row of the reduced dim (torch's softmax kernels for wide rows).
_ROW_WISE = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_softmax_backward_data",
             "_log_softmax_backward_data"}

_SDPA_FORWARD = {aten._scaled_dot_product_flash_attention_for_cpu.default}
_SDPA_BACKWARD = {aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


@dataclass(frozen=True)
class Kernel:
    """One kernel launch of the traced step."""

    op: str
    kind: str
    """GEMM, ATTENTION or OTHER (elementwise, reduction, copy, sort, optimizer's fused updates: 0 FLOPs)."""
    flops: float
    """Executed FLOPs (2 per multiply-add); a causal attention counts the half of the scores it computes."""
    bytes: int
    """Bytes read plus written."""
    dtype: str
    """The dtype of its first floating-point input (the GEMM's compute dtype)."""
    part: str
    phase: str
    tiles: tuple[int, int, int] = (0, 0, 0)
    """GEMMs: (groups or batch, M, N) of the output, for the wave model."""
    reads: tuple[tuple[int, int], ...] = ()
    """(storage id, bytes) of each tensor read."""
    writes: tuple[tuple[int, int], ...] = ()
    """(storage id, bytes) of each tensor written."""
    rows: int = 0
    """Row-wise kernels (the softmax family): the independent rows along which it is split, one thread block each
    on a GPU; 0 for the rest."""
    host_ops: int = 0
    """Ops dispatched since the previous kernel that launch none (views, allocations, host reads)."""
    sync: bool = False
    """A host read since the previous kernel: the host waited for the device's queue to drain before issuing it."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _part(fqn: str) -> str:
    """A model part from a module's qualified name (``ZayaForCausalLM.blocks.3.moe.experts``)."""
    for key, name in ((".experts", "moe experts"), (".router", "moe router"), (".moe", "moe other"),
                      ("_norm", "norms"), ("residual", "residual scaling"), (".attention", "attention"),
                      (".embed", "embedding")):
        if key in fqn:
            return name
    return "head and loss"


def _arg(func, args, kwargs, name: str, default):
    """An op's argument by its schema name, positional or keyword."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


class KernelRecorder(TorchDispatchMode):
    """``with KernelRecorder() as rec: ...``; ``rec.phase`` names what follows; ``rec.kernels`` is the list."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[Kernel] = []
        self.phase = "forward"
        self._ids: dict[int, int] = {}
        self._next = 0
        self._tracker = ModuleTracker()
        self._last_part = "head and loss"
        self._host_ops = 0
        self._sync = False

    def _id(self, t: torch.Tensor, fresh: bool) -> int:
        key = t.untyped_storage()._cdata
        if fresh or key not in self._ids:
            self._next += 1
            self._ids[key] = self._next
        return self._ids[key]

    def _where(self) -> str:
        if self.phase == "forward":
            self._last_part = _part(max(self._tracker.parents, key=len))
        elif self.phase == "backward":
            node = torch._C._current_autograd_node()
            self._last_part = (node.metadata.get(_PART) if node is not None else None) or self._last_part
        else:
            return self.phase
        return self._last_part

    def tag_backward(self, model: torch.nn.Module) -> None:
        """Name each autograd node of ``model``'s forward after the module that made it (innermost first), so that
        backward kernels are attributed to their forward's part; a node left untagged takes the previous one's."""
        def hook(module, _inputs, output, part: str = "") -> None:
            stack = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            while stack:
                node = stack.pop()
                if node is None or _PART in node.metadata:
                    continue
                node.metadata[_PART] = part
                stack.extend(f for f, _ in node.next_functions)

        prefix = type(model).__name__
        for name, module in model.named_modules():
            module.register_forward_hook(functools.partial(hook, part=_part(f"{prefix}.{name}")))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            # A host read (Muon's drift checks, a norm): a fake tensor has no value; read "zero", a healthy step's
            # flags; no kernel, but the next kernel is issued after the device's queue drained.
            self._host_ops += 1
            self._sync = True
            return args[0].dtype.is_floating_point and 0.0 or (False if args[0].dtype == torch.bool else 0)
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # metadata a fake tensor asks for (``prim.device``): no dispatch in eager
            return out
        if func in _NO_KERNEL or func.is_view:
            self._host_ops += 1
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_keys = {t.untyped_storage()._cdata for t in inputs}
        if outputs and not func._schema.is_mutable and all(t.untyped_storage()._cdata in in_keys for t in outputs):
            self._host_ops += 1
            return out  # an alias of an input (``_unsafe_view``, ``alias``): no kernel
        reads = tuple((self._id(t, False), _nbytes(t)) for t in inputs)
        if func in _GATHERS:
            reads = tuple(r for r, t in zip(reads, inputs) if not t.is_floating_point()) + tuple(
                (0, _nbytes(t)) for t in outputs)
        writes = tuple((self._id(t, t.untyped_storage()._cdata not in in_keys), _nbytes(t)) for t in outputs)
        flops, kind, tiles = self._flops(func, args, kwargs, out)
        floats = [t for t in inputs if t.is_floating_point()]
        dtype = str(floats[0].dtype).removeprefix("torch.") if floats else "none"
        name = str(func.overloadpacket.__name__)
        rows = 0
        if name in _ROW_WISE and outputs:
            rows = outputs[0].numel() // max(1, outputs[0].shape[_arg(func, args, kwargs, "dim", -1)])
        self.kernels.append(Kernel(name, kind, flops, sum(b for _, b in reads) + sum(b for _, b in writes), dtype,
                                   self._where(), self.phase, tiles, reads, writes, rows, self._host_ops, self._sync))
        self._host_ops, self._sync = 0, False
        return out

    @staticmethod
    def _flops(func, args, kwargs, out) -> tuple[float, str, tuple[int, int, int]]:
        name = func.overloadpacket.__name__
        if func in _SDPA_FORWARD or func in _SDPA_BACKWARD:
            q, k, v = (args[1], args[2], args[3]) if func in _SDPA_BACKWARD else args[:3]
            causal = bool(_arg(func, args, kwargs, "is_causal", False))
            shapes = tuple(q.shape), tuple(k.shape), tuple(v.shape)
            flops = sdpa_backward_flop_count(tuple(args[0].shape), *shapes) if func in _SDPA_BACKWARD \
                else sdpa_flop_count(*shapes)
            return flops * (0.5 if causal else 1.0), ATTENTION, (0, 0, 0)
        if name in GROUPED_GEMMS:
            a, b = args[0], args[1]
            if b.dim() == 3:  # [M, K] x [E, K, N] -> [M, N], rows split among the E groups
                groups, (m, n), k = b.shape[0], out.shape, a.shape[1]
                return 2.0 * m * n * k, GEMM, (groups, math.ceil(m / groups), n)
            # [N, M] x [M, K] -> [E, N, K], the M rows split among the E groups (a weight gradient)
            groups, n, k = out.shape
            return 2.0 * n * a.shape[1] * k, GEMM, (groups, n, k)
        if func is aten.convolution_backward.default:
            # torch's formula ignores the groups of a grouped convolution's backward (CCA's are grouped): each
            # gradient asked for (input, weight) costs what the forward does.
            grad_out, x, w = args[:3]
            forward = flop_registry[aten.convolution](x.shape, w.shape, None, None, None, None, args[7],
                                                      out_val=grad_out)
            return float(forward * sum(bool(m) for m in args[10][:2])), GEMM, (0, 0, 0)
        if func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            if not isinstance(out, torch.Tensor):
                return float(flops), GEMM, (0, 0, 0)
            shape = tuple(out.shape)
            batch = 1 if len(shape) < 3 else shape[0]
            kind = ATTENTION if "attention" in name else GEMM
            return float(flops), kind, (batch, shape[-2] if len(shape) > 1 else 1, shape[-1])
        return 0.0, OTHER, (0, 0, 0)


@contextlib.contextmanager
def planned_as(profile: HardwareProfile) -> Iterator[None]:
    """Trace under ``profile``'s plans (the loss's chunk, Newton-Schulz's blocks and stacking): the target device's,
    not this CPU's. A temporary profile file named by $ZAYA_HARDWARE_PROFILE for the duration."""
    from zaya.core.hardware import clear_cache

    saved = os.environ.get(PROFILE_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(profile.to_json())
        os.environ[PROFILE_ENV] = path
        clear_cache()
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(PROFILE_ENV, None)
            else:
                os.environ[PROFILE_ENV] = saved
            clear_cache()


def gpu_plans(loss_chunk_elements: int) -> HardwareProfile:
    """The plans a GPU runs: Newton-Schulz unblocked and stacked by shape (as ``zaya.optim.newton_schulz`` does
    off the CPU), the loss in chunks of ``loss_chunk_elements``."""
    return HardwareProfile(muon_max_blocks=1, muon_cpu_small=1 << 30, loss_chunk_elements=loss_chunk_elements)


def trace_step(cfg: ModelConfig, batch: int, seq_len: int, *, dtype: str = "bfloat16",
               plans: HardwareProfile | None = None, optimizer: bool = True, ns_method: str = "auto") -> list[Kernel]:
    """The kernels of one training step of ``batch`` x ``seq_len`` tokens through ``cfg``: forward with labels
    under autocast (``dtype``), backward, gradient clipping, Muon (Newton-Schulz in ``dtype``) + AdamW, zero_grad.
    ``plans``: the target device's plans (default: this machine's profile)."""
    from zaya.optim.build import build_optimizers, split_parameters
    from zaya.tune.activation_trace import fake_model

    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    with (planned_as(plans) if plans is not None else contextlib.nullcontext()), \
            fake_model(cfg, batch * seq_len, dtype=dtype, max_loss_chunks=None) as model:
        ocfg = dataclasses.replace(OptimConfig(), muon_ns_dtype=dtype, muon_ns_method=ns_method)
        split = split_parameters(model, ocfg.muon)
        optimizers = build_optimizers(split, ocfg)
        params = [p for p in model.parameters() if p.requires_grad]
        ids = torch.randint(3, cfg.vocab_size, (batch, seq_len))
        rec = KernelRecorder()
        rec.tag_backward(model)
        with rec, rec._tracker:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == torch.bfloat16):
                out = model(ids, labels=ids)
                loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
                rec.phase = "backward"
                loss.backward()
            if optimizer:
                rec.phase = "clip"
                torch.nn.utils.clip_grad_norm_(params, ocfg.grad_clip)
                rec.phase = "optimizer"
                for opt in optimizers:
                    opt.step()
                model.zero_grad(set_to_none=True)
        return rec.kernels

