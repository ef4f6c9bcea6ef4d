"""What each rank writes, and the host-memory copies an async save writes while training changes the live tensors.

**Ownership.** The store hands DCP a flat dictionary ``{key: tensor}`` per rank. Under DDP and ZeRO-1 every rank
holds the full replicated model (under DDP the full optimizer state too), yet a checkpoint needs one copy: so a
plain-tensor key that several ranks hold with the same shape and dtype (DCP assumes such tensors are identical) is
*owned* by exactly one of them, chosen by ``assign_owners`` (``zaya.core.balance``): largest first, each to the
least-loaded holder, a rank's load starting at the bytes it must write anyway (keys only it holds, such as ZeRO-1's
optimizer state, and its DTensor shards under FSDP2). Deterministic: every rank computes the same assignment from
one all-gather of ``(key, kind, dtype, shape, bytes)`` rows. Each rank then stages, DCP-saves and RAM-copies only
what it owns; DCP merges the ranks' plans into one ``.metadata``, so the union on disk is complete.

**Staging.** ``stage`` copies every tensor of a flat state into host memory. A DTensor (FSDP2) stays a DTensor with
the same mesh and placements, its local shard copied, which is what DCP needs to write each rank's part. Buffers
are kept in a ``HostBuffers`` and reused while shapes match, so a run pays the allocation (and the page faults)
once, not at every save. Every buffer's storage is exactly its tensor's size (DCP's writer clones any tensor whose
storage is larger than itself). On CPU that is a plain ``torch.empty``. From a GPU the copies go to page-locked
memory and run asynchronously until one synchronisation at the end; that memory is one anonymous ``mmap`` of the
exact total size registered with ``cudaHostRegister`` (``pinned_empty``: one registration, however many tensors),
each tensor a ``torch.frombuffer`` view of its own bytes, instead of torch's caching host allocator, which rounds
every pinned block up to a power of two (a 20 GiB state would pin 32 GiB). The mapping is unregistered before it
goes, when the layout changes or the store closes (``HostBuffers.release``).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from zaya.core.balance import balance


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def local_of(value: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return value.to_local() if is_dtensor(value) else value


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def tensor_bytes(value: Any) -> int:
    """Bytes of this rank's tensors in a nested state (local shards for DTensors)."""
    if isinstance(value, torch.Tensor):
        return nbytes_of(local_of(value))
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


# --- ownership ---------------------------------------------------------------------------------------------------
def ownership_rows(flat: Mapping[str, torch.Tensor]) -> list[tuple[str, str, str, tuple[int, ...], int]]:
    """This rank's ``(key, kind, dtype, shape, local bytes)`` rows (kind "tensor" or "dtensor"), sorted by key."""
    rows = []
    for key in sorted(flat):
        value = flat[key]
        kind = "dtensor" if is_dtensor(value) else "tensor"
        rows.append((key, kind, str(value.dtype), tuple(value.shape), nbytes_of(local_of(value))))
    return rows


@dataclass
class Ownership:
    """Who writes what (see the module docstring). ``owner`` maps every replicated key (several holders) to the
    rank that writes it; any other key is written by each rank that holds it."""

    rank: int
    rows: list
    """This rank's ``ownership_rows`` when it was computed: the store recomputes when any rank's rows change."""
    owner: dict[str, int] = field(default_factory=dict)
    replicated: list = field(default_factory=list)
    """``[key, owner, dtype, shape, holders]`` for every replicated key, sorted by key (the RAM tier keeps it)."""
    rank_bytes: list[int] = field(default_factory=list)
    """Bytes each rank writes."""

    def owns(self, key: str) -> bool:
        return self.owner.get(key, self.rank) == self.rank

    def owned(self, flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in flat.items() if self.owns(k)}

    @property
    def total_bytes(self) -> int:
        return sum(self.rank_bytes)


def assign_owners(gathered: list[list], rank: int) -> Ownership:
    """The ownership computed from every rank's ``ownership_rows`` (``gathered[r]`` is rank r's)."""
    world = len(gathered)
    holders: dict[str, list[tuple[int, str, tuple, int]]] = {}
    for r, rows in enumerate(gathered):
        for key, kind, dtype, shape, nbytes in rows:
            if kind == "tensor":
                holders.setdefault(key, []).append((r, dtype, tuple(shape), nbytes))
    replicated = {key: hs for key, hs in holders.items()
                  if len(hs) > 1 and len({(d, s) for _, d, s, _ in hs}) == 1}
    load = [0] * world
    for r, rows in enumerate(gathered):
        for key, kind, dtype, shape, nbytes in rows:
            if key not in replicated:  # a DTensor shard, a key only this rank holds (or one the ranks disagree on)
                load[r] += nbytes
    owner = balance({key: hs[0][3] for key, hs in replicated.items()}, load,
                    {key: [r for r, _, _, _ in hs] for key, hs in replicated.items()})
    table = [[key, owner[key], replicated[key][0][1], list(replicated[key][0][2]),
              [r for r, _, _, _ in replicated[key]]] for key in sorted(replicated)]
    return Ownership(rank, list(gathered[rank]), owner, table, load)


# --- host buffers ------------------------------------------------------------------------------------------------
_ALIGN = 64


class PinnedArena:
    """Page-locked host tensors for ``layout`` (``[(key, shape, dtype)]``): one anonymous mapping of their total
    size (each tensor 64-byte aligned), registered once with ``cudaHostRegister``. Each tensor is a
    ``torch.frombuffer`` view of its own bytes, so its storage is exactly its size. ``release`` unregisters the
    mapping; the mapping itself goes with the last reference to it (after the unregistration, never before)."""

    def __init__(self, layout: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.layout = layout
        offsets, total = [], 0
        for _, shape, dtype in layout:
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += _numel(shape) * dtype.itemsize
        self.nbytes = total
        self._map: mmap.mmap | None = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensors = {key: torch.frombuffer(self._map, dtype=dtype, count=_numel(shape), offset=off).view(shape)
                        for (key, shape, dtype), off in zip(layout, offsets)}
        self.ptr = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        code = int(torch.cuda.cudart().cudaHostRegister(self.ptr, total, 0))
        self.registered = code == 0
        if not self.registered:
            self.tensors, self._map = {}, None
            raise RuntimeError(f"cudaHostRegister of {total:,} bytes failed (cudaError {code}); the locked-memory "
                               "limit (ulimit -l) may be too low")

    def release(self) -> None:
        if self.registered:
            self.registered = False
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        self.tensors, self._map = {}, None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pinned_empty(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> PinnedArena:
    """Exactly-sized page-locked host tensors for device-to-host copies (CUDA only)."""
    return PinnedArena(layout)


class HostBuffers:
    """The staging buffers of one store, reused across saves while the keys, shapes and dtypes stay the same:
    plain ``torch.empty`` tensors for CPU sources, one ``PinnedArena`` for the CUDA ones."""

    def __init__(self) -> None:
        self._plain: dict[str, torch.Tensor] = {}
        self._arena: PinnedArena | None = None
        self.pin_failed = ""
        """Why pinning failed (staging then goes on in pageable memory), or ""."""

    def prepare(self, flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A host buffer for (the local shard of) every tensor of ``flat``; releases those no longer needed."""
        locals_ = {k: local_of(v) for k, v in flat.items()}
        layout = [(k, tuple(t.shape), t.dtype) for k, t in locals_.items()
                  if t.device.type == "cuda" and t.numel() > 0]
        if self._arena is not None and (self._arena.layout != layout or self.pin_failed):
            self._arena.release()
            self._arena = None
        if layout and self._arena is None and not self.pin_failed:
            try:
                self._arena = pinned_empty(layout)
            except Exception as exc:  # noqa: BLE001 - pageable memory still works, only slower
                self.pin_failed = str(exc)
        pinned = self._arena.tensors if self._arena is not None else {}
        out: dict[str, torch.Tensor] = {}
        for key, t in locals_.items():
            if key in pinned:
                out[key] = pinned[key]
                continue
            old = self._plain.get(key)
            if old is None or old.shape != t.shape or old.dtype != t.dtype:
                old = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            out[key] = old
        self._plain = {k: v for k, v in out.items() if k not in pinned}
        return out

    def release(self) -> None:
        """Release every buffer (the store closes)."""
        self._plain = {}
        if self._arena is not None:
            self._arena.release()
            self._arena = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors held (without the arena's alignment padding)."""
        pinned = self._arena.tensors.values() if self._arena is not None else ()
        return sum(nbytes_of(t) for t in (*self._plain.values(), *pinned))


def stage(flat: Mapping[str, torch.Tensor], buffers: HostBuffers) -> dict[str, torch.Tensor]:
    """A host-memory copy of the flat state ``flat`` in ``buffers`` (whose earlier contents are no longer in use)."""
    staged: dict[str, torch.Tensor] = {}
    any_cuda = False
    targets = buffers.prepare(flat)
    for key, value in flat.items():
        src = local_of(value).detach()
        on_cuda = src.device.type == "cuda"
        any_cuda |= on_cuda
        dst = targets[key]
        dst.copy_(src, non_blocking=on_cuda)
        if is_dtensor(value):
            from torch.distributed.tensor import DTensor

            # The constructor, not DTensor.from_local: from_local moves the local tensor to the mesh's device,
            # which for a GPU mesh would copy the staged state straight back onto the GPU.
            dst = DTensor(dst, value._spec, requires_grad=False)
        staged[key] = dst
    if any_cuda:
        torch.cuda.synchronize()
    return staged


def local_view(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The flat state with every DTensor replaced by its local shard: what this rank holds."""
    return {k: local_of(v) for k, v in flat.items()}
