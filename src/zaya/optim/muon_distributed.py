"""Muon across ranks: who orthogonalises which matrix, and how inputs and results travel.

Newton-Schulz costs O(m^2 n) per matrix, far more than the rest of the step, and without splitting every rank of
a data-parallel job would compute all of it; so each matrix is orthogonalised by one rank (its *owner*) and the
result shared. This module holds that communication, apart from the optimizer (``zaya.optim.muon``, which calls
these functions from ``Muon.step`` and runs the matrices given to this rank) and from the math
(``zaya.optim.newton_schulz``). Owners are assigned by a deterministic greedy balance of modelled FLOPs
(``zaya.core.balance.assign``), computed identically on every rank, so no rank has to be told who owns what.

* ``update_replicated`` (DDP: plain parameters, the same on every rank of ``replica_group``): each matrix (each
  expert of a 3-D parameter) is orthogonalised by one rank, and each rank broadcasts its results (one coalesced
  broadcast per rank and NS dtype); every rank applies every update, so parameters stay replicated. Momentum
  buffers stay full on every rank (they are cheap and keep the state dict unchanged).
* ``update_sharded`` (FSDP2: DTensors sharded ``Shard(0)`` on a 1-D mesh): stacked expert weights are split on
  the expert dimension, so each rank orthogonalises its own experts with no communication; every 2-D matrix is
  assigned to one rank (balancing the FLOPs including the experts), its row shards are sent to the owner with one
  ``all_to_all`` for all matrices, the owner orthogonalises it and a second ``all_to_all`` returns each rank its
  rows. Shards may be uneven (FSDP2's ``torch.chunk`` rule: ``ceil(rows / world)`` rows per rank, the last ones
  shorter or empty).
* ``update_gathered`` (the fallback: other meshes or placements, or ``distributed="local"``): every DTensor is
  all-gathered, every rank orthogonalises every matrix and keeps its own shard.

Drift checks ("Host reads" in docs/training.md). A Gram result's check is computed by the rank that
orthogonalised it, but every rank applying that result must agree on whether it gets corrected, and the
correction of a shared result is itself collective. So the checks travel with the results, in the same messages
(a slot per Gram-path matrix, known from the shapes alone: ``newton_schulz.gram_checked``): the broadcasts
(DDP) and the second ``all_to_all`` (FSDP) carry the owners' checks to every rank, and in the gathered fallback,
where every rank computes its own, they are summed over the mesh. Every rank then reads the same values at the
end of the step, and in the rare case of a flagged matrix all ranks take part in the same correction: the owner
recomputes ``O_gram - O_standard`` (FSDP: after the inputs are sent to it again) and shares it like a result.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Hashable

import torch
import torch.distributed as dist
from torch import Tensor

from zaya.core.balance import assign
from zaya.optim.muon_work import Entry, Runner, StepChecks, Task, _ignore, local
from zaya.optim.newton_schulz import gram_checked, ns_flops, plan, stacked

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover
    DTensor = Partial = Replicate = None  # type: ignore[assignment,misc]

__all__ = ["update_replicated", "update_sharded", "update_gathered", "chunk_sizes"]


def chunk_sizes(n: int, world: int) -> list[int]:
    """Rows per rank of a ``Shard(0)`` DTensor with ``n`` rows (``torch.chunk``'s rule, which FSDP2 uses)."""
    c = -(-n // world) if n else 0
    return [max(0, min(c, n - r * c)) for r in range(world)]


def _cost(e: Entry) -> float:
    """Modelled FLOPs of one matrix of ``e`` (one expert of a 3-D parameter)."""
    m0, n0 = e.shape
    m, n = min(m0, n0), max(m0, n0)
    method, nb = plan(e.cfg, m, n, e.p_local.device, stacked(m0, n0, e.p_local.device))
    return ns_flops(m, n, len(e.cfg.coeffs), method, nb, e.cfg.restarts)


def _checked(e: Entry, device: torch.device) -> bool:
    return gram_checked(*e.shape, e.cfg, device)


def _layout(peers: list[list[tuple[Hashable, int]]]) -> tuple[list[int], dict[Hashable, int]]:
    """Split sizes and offsets of one flat buffer made of one segment per peer, each a list of ``(key, size)``."""
    splits, at, pos = [], {}, 0
    for items in peers:
        start = pos
        for key, size in items:
            at[key] = pos
            pos += size
        splits.append(pos - start)
    return splits, at


def _write(dst: Tensor, at: int, src: Tensor) -> None:
    dst[at:at + src.numel()].view(src.shape).copy_(src)


# --- DDP: replicated parameters, one owner per matrix, results broadcast ---------------------------------------


def update_replicated(opt: Runner, entries: list[Entry], group: Any, checks: StepChecks) -> None:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device = entries[0].p_local.device
    items = [(e, i) for e in entries for i in e.matrices()]
    owner = assign([_cost(e) for e, _ in items], world)
    checked = [_checked(e, device) for e, _ in items]
    # Each owner's results, coalesced in item order, one flat buffer per (owner, ns dtype), followed by one slot
    # per Gram-path item of that buffer for its drift check.
    layout: dict[tuple[int, torch.dtype], int] = defaultdict(int)
    offsets = []
    for (e, _), r in zip(items, owner):
        key = (r, e.cfg.dtype)
        offsets.append(layout[key])
        layout[key] += e.shape[0] * e.shape[1]
    flag_at: dict[int, int] = {}
    for k, ((e, _), r) in enumerate(zip(items, owner)):
        if checked[k]:
            key = (r, e.cfg.dtype)
            flag_at[k] = layout[key]
            layout[key] += 1
    flats = {key: torch.empty(size, dtype=key[1], device=device) for key, size in layout.items()}

    def sink(flat: Tensor, off: int, m0: int, n0: int, ortho: Tensor) -> None:
        flat[off:off + m0 * n0].view(m0, n0).copy_(ortho)

    def flag(flat: Tensor, off: int, f: Tensor) -> None:
        flat[off:off + 1].copy_(f)

    tasks, task_of = [], {}
    for k, ((e, i), r, off) in enumerate(zip(items, owner, offsets)):
        if r == rank:
            m0, n0 = e.shape
            flat = flats[(r, e.cfg.dtype)]
            task_of[k] = len(tasks)
            tasks.append(Task(m0, n0, e.cfg, device, functools.partial(e.fill, index=i),
                              functools.partial(sink, flat, off, m0, n0), e.grad.dtype,
                              flag=functools.partial(flag, flat, flag_at[k]) if checked[k] else _ignore))
    opt._run(tasks)
    global_ranks = [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r for r in range(world)]
    works = {key: dist.broadcast(flat, src=global_ranks[key[0]], group=group, async_op=True)
             for key, flat in sorted(flats.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))}
    for (e, i), r, off in zip(items, owner, offsets):
        key = (r, e.cfg.dtype)
        if works.get(key) is not None:
            works.pop(key).wait()
        m0, n0 = e.shape
        e.apply(flats[key][off:off + m0 * n0].view(m0, n0), index=i)
    for w in works.values():
        w.wait()

    flagged_items = sorted(flag_at)
    if not flagged_items:
        return

    def resolve(bad: list[bool]) -> None:
        fix = [k for k, b in zip(flagged_items, bad) if b]  # the same on every rank: the checks were broadcast
        if not fix:
            return
        sizes: dict[int, int] = defaultdict(int)
        at = {}
        for k in fix:
            at[k] = sizes[owner[k]]
            sizes[owner[k]] += items[k][0].shape[0] * items[k][0].shape[1]
        deltas = {r: torch.empty(n, dtype=torch.float32, device=device) for r, n in sorted(sizes.items())}
        mine = set()
        for k in fix:
            if owner[k] == rank:
                tasks[task_of[k]].fix = functools.partial(_write, deltas[rank], at[k])
                mine.add(task_of[k])
        if mine:
            opt._run(tasks, mine)
            opt.gram_fallbacks += len(mine)
        for r, d in deltas.items():
            dist.broadcast(d, src=global_ranks[r], group=group)
        for k in fix:
            (e, i), r = items[k], owner[k]
            m0, n0 = e.shape
            e.correct(deltas[r][at[k]:at[k] + m0 * n0].view(m0, n0), index=i)

    checks.add([flats[(owner[k], items[k][0].cfg.dtype)][flag_at[k]:flag_at[k] + 1] for k in flagged_items],
               resolve)


# --- FSDP2: Shard(0) DTensors; experts local, 2-D matrices gathered to an owner ----------------------------------


def update_sharded(opt: Runner, mesh: Any, entries: list[Entry], checks: StepChecks) -> None:
    world = mesh.size()
    rank = mesh.get_local_rank()
    group = mesh.get_group()
    device = entries[0].p_local.device
    load = [0.0] * world
    expert_entries, matrices = [], []
    for e in entries:
        sizes = chunk_sizes(e.param.shape[0], world)
        if e.p_local.shape[0] != sizes[rank]:
            raise RuntimeError(
                f"Muon: a Shard(0) DTensor of shape {tuple(e.param.shape)} has {e.p_local.shape[0]} local rows "
                f"on rank {rank}, expected {sizes[rank]} (torch.chunk's rule); use distributed='local'")
        if e.param.ndim == 3:
            expert_entries.append(e)
            cost = _cost(e)
            for r in range(world):
                load[r] += sizes[r] * cost
        else:
            starts = [sum(sizes[:r]) for r in range(world)]
            matrices.append((e, sizes, starts))
    owner = assign([_cost(e) for e, _, _ in matrices], world, load)
    mine = [j for j, r in enumerate(owner) if r == rank]
    owned = [[j for j in range(len(matrices)) if owner[j] == s] for s in range(world)]
    checked = [_checked(e, device) for e, _, _ in matrices]
    owned_checked = [[j for j in owned[s] if checked[j]] for s in range(world)]
    dtype = matrices[0][0].cfg.dtype if matrices else entries[0].cfg.dtype
    if any(e.cfg.dtype != dtype for e, _, _ in matrices):
        raise ValueError("Muon: FSDP parameters sharing a mesh must use one ns_dtype")

    def rows(j: int, r: int) -> int:
        e, sizes, _ = matrices[j]
        return sizes[r] * e.shape[1]

    # Phase 1: every rank sends its rows of each matrix to the matrix's owner (one all_to_all).
    send_split, send_at = _layout([[(j, rows(j, rank)) for j in owned[d]] for d in range(world)])
    recv_split, recv_at = _layout([[((s, j), rows(j, s)) for j in mine] for s in range(world)])

    def to_owners() -> tuple[Tensor, Tensor, Any]:
        """(send, recv, work): keep ``send`` alive until ``work`` is waited on."""
        send = torch.empty(sum(send_split), dtype=dtype, device=device)
        for j, (e, sizes, _) in enumerate(matrices):
            if sizes[rank]:
                e.fill(send[send_at[j]:send_at[j] + rows(j, rank)].view(sizes[rank], e.shape[1]))
        recv = torch.empty(sum(recv_split), dtype=dtype, device=device)
        return send, recv, dist.all_to_all_single(recv, send, recv_split, send_split, group=group, async_op=True)

    def fill(recv: Tensor, j: int, dst: Tensor) -> None:
        e, sizes, starts = matrices[j]
        n0 = e.shape[1]
        for s in range(world):
            if sizes[s]:
                at = recv_at[(s, j)]
                dst[starts[s]:starts[s] + sizes[s]].copy_(recv[at:at + sizes[s] * n0].view(sizes[s], n0))

    send, recv, work = to_owners() if matrices else (None, None, None)

    # Meanwhile: this rank's own experts (no communication).
    opt._run_local(opt._local_tasks(expert_entries), checks)
    if work is None:
        return
    work.wait()
    del send

    # Phase 2: owners orthogonalise and send each rank its rows back (second all_to_all), each segment followed by
    # the drift checks of the owner's Gram-path matrices, so that every rank gets every check.
    back_split, back_at = _layout([[((d, j), rows(j, d)) for j in mine] + [(("flags", d), len(owned_checked[rank]))]
                                   for d in range(world)])
    ret_split, ret_at = _layout([[(j, rows(j, rank)) for j in owned[s]] + [(("flags", s), len(owned_checked[s]))]
                                 for s in range(world)])
    back = torch.empty(sum(back_split), dtype=dtype, device=device)
    my_flags = torch.empty(len(owned_checked[rank]), dtype=dtype, device=device)
    flag_pos = {j: p for p, j in enumerate(owned_checked[rank])}

    def sink(j: int, ortho: Tensor) -> None:
        e, sizes, starts = matrices[j]
        n0 = e.shape[1]
        for d in range(world):
            if sizes[d]:
                at = back_at[(d, j)]
                back[at:at + sizes[d] * n0].view(sizes[d], n0).copy_(ortho[starts[d]:starts[d] + sizes[d]])

    def flag(j: int, f: Tensor) -> None:
        my_flags[flag_pos[j]:flag_pos[j] + 1].copy_(f)

    tasks = [Task(*matrices[j][0].shape, matrices[j][0].cfg, device, functools.partial(fill, recv, j),
                  functools.partial(sink, j), dtype, flag=functools.partial(flag, j) if checked[j] else _ignore)
             for j in mine]
    opt._run(tasks)
    del recv
    if my_flags.numel():
        for d in range(world):
            _write(back, back_at[("flags", d)], my_flags)
    ret = torch.empty(sum(ret_split), dtype=dtype, device=device)
    dist.all_to_all_single(ret, back, ret_split, back_split, group=group)
    del back
    for j, (e, sizes, _) in enumerate(matrices):
        if sizes[rank]:
            e.apply(ret[ret_at[j]:ret_at[j] + rows(j, rank)].view(sizes[rank], e.shape[1]))

    flag_order = [j for s in range(world) for j in owned_checked[s]]
    if not flag_order:
        return
    flag_views = [ret[ret_at[("flags", s)]:ret_at[("flags", s)] + len(owned_checked[s])] for s in range(world)
                  if owned_checked[s]]

    def resolve(bad: list[bool]) -> None:
        fix = sorted(j for j, b in zip(flag_order, bad) if b)  # the same on every rank: the checks came back
        if not fix:
            return
        fixed = set(fix)
        # Send the inputs to the owners again (the gradients and buffers are unchanged), recompute the runs that
        # hold a flagged matrix, and return each rank its rows of O_gram - O_standard.
        send2, recv2, work2 = to_owners()
        work2.wait()
        del send2
        dback_split, dback_at = _layout([[((d, j), rows(j, d)) for j in mine if j in fixed] for d in range(world)])
        dret_split, dret_at = _layout([[(j, rows(j, rank)) for j in owned[s] if j in fixed] for s in range(world)])
        dback = torch.empty(sum(dback_split), dtype=torch.float32, device=device)

        def fix_sink(j: int, delta: Tensor) -> None:
            e, sizes, starts = matrices[j]
            for d in range(world):
                if sizes[d]:
                    _write(dback, dback_at[(d, j)], delta[starts[d]:starts[d] + sizes[d]])

        redo = set()
        for pos, (t, j) in enumerate(zip(tasks, mine)):
            t.fill = functools.partial(fill, recv2, j)
            if j in fixed:
                t.fix = functools.partial(fix_sink, j)
                redo.add(pos)
        if redo:
            opt._run(tasks, redo)
            opt.gram_fallbacks += len(redo)
        del recv2
        dret = torch.empty(sum(dret_split), dtype=torch.float32, device=device)
        dist.all_to_all_single(dret, dback, dret_split, dback_split, group=group)
        for j in fix:
            e, sizes, _ = matrices[j]
            if sizes[rank]:
                e.correct(dret[dret_at[j]:dret_at[j] + rows(j, rank)].view(sizes[rank], e.shape[1]))

    checks.add(flag_views, resolve)


# --- fallback: gather every matrix on every rank -----------------------------------------------------------------


def _local_shard_of(full: Tensor, like: Tensor) -> Tensor:
    """``full`` (the same on every rank) as a DTensor placed like ``like``: a local slice, no communication."""
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements)


def _gather_update(e: Entry) -> Tensor:
    return DTensor.from_local(
        e.grad.lerp(e.buf, e.momentum) if e.nesterov else e.buf, e.param.device_mesh, e.param.placements,
        shape=e.param.shape, stride=e.param.stride(), run_check=False,
    ).to(e.cfg.dtype).full_tensor()


def _copy_in(src: Tensor, i: int | None, dst: Tensor) -> None:
    dst.copy_(src if i is None else src[i])


def _copy_out(out: Tensor, i: int | None, ortho: Tensor) -> None:
    (out if i is None else out[i]).copy_(ortho)


def update_gathered(opt: Runner, entries: list[Entry], checks: StepChecks) -> None:
    pending: dict[Any, list[tuple[Entry, list[Task], list[tuple[int, Tensor]]]]] = {}
    for e in entries:
        full_u = _gather_update(e)
        ortho_full = torch.empty_like(full_u)
        m0, n0 = e.shape
        idx = [None] if full_u.ndim == 2 else list(range(full_u.size(0)))
        flags: list[tuple[int, Tensor]] = []
        tasks = [Task(m0, n0, e.cfg, full_u.device, functools.partial(_copy_in, full_u, i),
                      functools.partial(_copy_out, ortho_full, i), e.cfg.dtype,
                      flag=functools.partial(_collect, flags, k)) for k, i in enumerate(idx)]
        opt._run(tasks)
        e.apply(local(_local_shard_of(ortho_full, e.param)))
        if gram_checked(m0, n0, e.cfg, full_u.device):
            pending.setdefault(e.param.device_mesh, []).append((e, tasks, flags))

    # Every rank computed every check from the same data; summing them over the mesh makes sure all ranks agree
    # on the (collective) corrections even if a kernel were not bitwise reproducible across devices.
    for mesh, part in pending.items():
        flat = torch.cat([f.reshape(-1) for _, _, fl in part for _, f in fl]).to(torch.float32)
        total = DTensor.from_local(flat, mesh, [Partial()] * mesh.ndim, run_check=False).full_tensor()
        checks.add([total > 0], functools.partial(_resolve_gathered, opt, part))


def _collect(flags: list[tuple[int, Tensor]], k: int, f: Tensor) -> None:
    flags.append((k, f))


def _resolve_gathered(opt: Runner, part: list[tuple[Entry, list[Task], list[tuple[int, Tensor]]]],
                      bad: list[bool]) -> None:
    pos = 0
    for e, tasks, flags in part:
        fix = {k for n, (k, _) in enumerate(flags) if bad[pos + n]}
        pos += len(flags)
        if not fix:
            continue
        full_u = _gather_update(e)  # collective, on every rank: the flags are the same everywhere
        delta_full = torch.zeros(full_u.shape, dtype=torch.float32, device=full_u.device)
        for k, t in enumerate(tasks):
            i = None if full_u.ndim == 2 else k
            t.fill = functools.partial(_copy_in, full_u, i)
            t.fix = functools.partial(_copy_out, delta_full, i)
        opt._run(tasks, fix)
        opt.gram_fallbacks += len(fix)
        e.correct(local(_local_shard_of(delta_full, e.param)))
