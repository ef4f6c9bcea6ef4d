"""Distributed Muon on 2 and 3 gloo ranks equals the single-process optimizer, with the NS work split.

* DDP (``replica_group``): replicated plain parameters; each matrix (each expert) orthogonalised by one rank,
  results broadcast; compared bit for bit with one process.
* FSDP2 (``distributed="auto"``): Shard(0) DTensors with uneven (and empty) shards; experts orthogonalised where
  they live, 2-D matrices gathered to one owner each (all_to_all) and scattered back; compared with one process
  and with the gather-everything fallback (``"local"``).
* Drift checks: every step reads the device once on every rank (``HostReads``), and with a stand-in check that
  flags some Gram results, the corrections (collective on these paths) give the single-process results.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import run_ok
from zaya.distributed.checks import HostReads
from zaya.optim import Muon, newton_schulz
from zaya.optim.muon_distributed import chunk_sizes

KW = dict(lr=0.05, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")

# DDP parameters: small experts (batched), a tall and two same-shape matrices, a Gram-path matrix (130x600) and
# large experts (one at a time, Gram iteration): 3 + 1 + 2 + 1 + 2 = 9 matrices.
DDP_SHAPES = [(3, 12, 20), (40, 12), (16, 24), (16, 24), (130, 600), (2, 256, 640)]
DDP_MATRICES = 9


def ddp_params():
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in DDP_SHAPES]


def first_element_positive(out, cfg):
    """A stand-in drift check that flags some Gram results and not others, the same whichever rank computes it."""
    return out[..., 0, 0] > 0


def stepped(opt, reads: list[int]) -> None:
    """``opt.step()``, recording its host reads."""
    with HostReads() as r:
        opt.step()
    reads.append(r.total)


def ddp_train(replica_group=None, steps: int = 2, ns_dtype=torch.bfloat16):
    params = ddp_params()
    opt = Muon(params, **KW, replica_group=replica_group, ns_dtype=ns_dtype)
    g = torch.Generator().manual_seed(1)
    counts, reads = [], []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        stepped(opt, reads)
        counts.append(opt.ns_matrices)
    return [p.detach().clone() for p in params], counts, reads, opt.gram_fallbacks


class Tiny(nn.Module):
    """Parameters whose row counts do not divide by 2 or 3 ranks."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 7, bias=False)  # [7, 6]: rows 4+3 on 2 ranks, 3+3+1 on 3
        self.down = nn.Linear(7, 4, bias=False)  # [4, 7]: 2+2, and 2+2+0 (an empty shard) on 3 ranks
        self.wide = nn.Linear(600, 130, bias=False)  # [130, 600]: the Gram iteration; 65+65, 44+44+42
        self.experts = nn.Parameter(torch.randn(3, 7, 5) * 0.3)  # experts 2+1, 1+1+1
        self.experts2 = nn.Parameter(torch.randn(2, 5, 9) * 0.3)  # experts 1+1, 1+1+0

    def forward(self, x, x2):  # x [B, 6], x2 [B, 600]
        h = torch.tanh(self.proj(x))
        y = torch.einsum("bo,eoi->bei", h, self.experts)
        z = torch.einsum("bei,fij->befj", y, self.experts2)
        return z.square().mean() + self.down(h).square().mean() + self.wide(x2).square().mean()


TINY_MATRICES = 3 + 2 + 3  # experts, experts2, proj/down/wide


def fsdp_train(model, distributed: str = "auto", steps: int = 2, ns_dtype=torch.bfloat16):
    opt = Muon(model.parameters(), **KW, distributed=distributed, ns_dtype=ns_dtype)
    g = torch.Generator().manual_seed(123)
    counts, reads = [], []
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g), torch.randn(4, 600, generator=g)).backward()
        stepped(opt, reads)
        counts.append(opt.ns_matrices)
    return opt, counts, reads


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    out = {}
    out["ddp"], out["ddp_counts"], out["ddp_reads"], _ = ddp_train(dist.group.WORLD)
    real_check = newton_schulz.drift_flags
    newton_schulz.drift_flags = first_element_positive
    try:
        fix = ddp_train(dist.group.WORLD, ns_dtype=torch.float32)
        out["ddp_fix"], _, out["ddp_fix_reads"], out["ddp_fix_fallbacks"] = fix
    finally:
        newton_schulz.drift_flags = real_check

    # The trainer's choice (build_optimizers): plain parameters are split over the replica group it passes
    # (DDP's), not without one (ZeRO-1's per-rank subsets), and nothing is split when configured "local".
    from zaya.config import OptimConfig
    from zaya.optim.build import ParamSplit, build_optimizers

    named = [(f"w{i}", p) for i, p in enumerate(ddp_params())]
    ddp = build_optimizers(ParamSplit(named, [], []), OptimConfig(), replica_group=dist.group.WORLD)[0]
    assert ddp.distributed == "auto" and ddp._replicas() is dist.group.WORLD
    zero1 = build_optimizers(ParamSplit(named[rank::world], [], []), OptimConfig())[0]
    assert zero1.distributed == "auto" and zero1._replicas() is None
    local = build_optimizers(ParamSplit(named, [], []), OptimConfig(muon_distributed="local"),
                             replica_group=dist.group.WORLD)[0]
    assert local.distributed == "local" and local._replicas() is None

    mesh = init_device_mesh("cpu", (world,))
    for mode, ns_dtype, check in (("auto", torch.float32, ""), ("auto", torch.bfloat16, ""),
                                  ("local", torch.bfloat16, ""), ("auto", torch.float32, "fix"),
                                  ("local", torch.float32, "fix")):
        torch.manual_seed(0)
        model = Tiny()
        fully_shard(model, mesh=mesh)
        if check:
            newton_schulz.drift_flags = first_element_positive
        try:
            opt, counts, reads = fsdp_train(model, mode, ns_dtype=ns_dtype)
        finally:
            newton_schulz.drift_flags = real_check
        mode = f"{mode}_{str(ns_dtype)[6:]}" + (f"_{check}" if check else "")
        out[f"fsdp_{mode}_reads"] = reads
        out[f"fsdp_{mode}_fallbacks"] = opt.gram_fallbacks
        for name, p in model.named_parameters():
            buf = opt.state[p]["momentum_buffer"]
            assert isinstance(p, DTensor) and isinstance(buf, DTensor), name
            assert p.placements == (Shard(0),) and buf.placements == p.placements, name
            assert buf.to_local().shape == p.to_local().shape, name
            assert p.to_local().shape[0] == chunk_sizes(p.shape[0], world)[rank], name
        out[f"fsdp_{mode}"] = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        out[f"fsdp_{mode}_counts"] = counts
    return out


def fsdp_reference():
    torch.manual_seed(0)
    model = Tiny()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, counts, reads = fsdp_train(model, ns_dtype=torch.float32)
    fsdp = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name in fsdp:
        assert not torch.equal(fsdp[name], init[name])  # it trained
    assert counts == [TINY_MATRICES] * 2 and reads == [1, 1]  # wide (130x600) takes the Gram path
    return fsdp, opt.gram_fallbacks


@pytest.fixture(scope="module")
def single_process():
    """The references, computed with one intra-op thread as each rank runs: fp32 GEMM results depend on the thread
    count on some CPUs (measured on an AMX Xeon: the 130x600 Gram-path matrix moves by 1.5e-7 between 1 and 2
    threads), and the DDP comparisons below are bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _single_process()
    finally:
        torch.set_num_threads(threads)


def _single_process():
    ddp, ddp_counts, ddp_reads, _ = ddp_train()
    assert ddp_counts == [DDP_MATRICES] * 2 and ddp_reads == [1, 1]
    fsdp, fallbacks = fsdp_reference()
    assert fallbacks == 0
    patch = pytest.MonkeyPatch()
    patch.setattr(newton_schulz, "drift_flags", first_element_positive)
    try:
        ddp_fix, _, _, ddp_fallbacks = ddp_train(ns_dtype=torch.float32)  # fp32: quicker on the CPU
        fsdp_fix, fsdp_fallbacks = fsdp_reference()
    finally:
        patch.undo()
    # The stand-in check flags some of the Gram results (2 steps x 3 Gram-path matrices for DDP, 2 x 1 for
    # FSDP), and the corrections change the results.
    assert 0 < ddp_fallbacks < 6 and fsdp_fallbacks > 0
    assert not all(torch.equal(a, b) for a, b in zip(ddp_fix, ddp))
    assert not torch.equal(fsdp_fix["wide.weight"], fsdp["wide.weight"])
    return dict(ddp=ddp, fsdp=fsdp, ddp_fix=ddp_fix, ddp_fallbacks=ddp_fallbacks, fsdp_fix=fsdp_fix,
                fsdp_fallbacks=fsdp_fallbacks)


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_muon_matches_single_process(world, single_process):
    ddp_ref, fsdp_ref = single_process["ddp"], single_process["fsdp"]
    got = run_ok(_worker, world)

    # DDP: every rank applies the same broadcast updates to the same params; each matrix was orthogonalised by
    # one rank with the single-process code on the same input, so the result is bit-identical.
    for r in range(world):
        for a, b in zip(got[r]["ddp"], ddp_ref):
            assert torch.equal(a, b)
    per_rank = [got[r]["ddp_counts"] for r in range(world)]
    assert [sum(c[s] for c in per_rank) for s in range(2)] == [DDP_MATRICES] * 2  # each matrix exactly once
    assert all(0 < c[0] < DDP_MATRICES for c in per_rank)

    # FSDP2, fp32 NS against one process: every rank sees the same data, so the reduce-scattered mean gradient
    # is the single-process one up to reduction noise ((g + g + g) / 3 is not exactly g in fp32: ~1e-7
    # relative), which fp32 NS carries through (measured: up to 1.1e-6 on 3 ranks, 7.5e-8 on 2); 5e-6 leaves
    # room for that only, while a misplaced shard or a wrong owner moves params by ~lr_adj ~ 1e-1. (In bf16 that
    # noise flips roundings of the NS input and the results differ at bf16 level, ~3e-3 on 3 ranks.)
    for r in range(world):
        for name, want in fsdp_ref.items():
            for mode in ("auto_float32", "auto_bfloat16", "local_bfloat16"):
                assert torch.equal(got[r][f"fsdp_{mode}"][name], got[0][f"fsdp_{mode}"][name]), (mode, name)
            torch.testing.assert_close(got[r]["fsdp_auto_float32"][name], want, rtol=0, atol=5e-6)
            # bf16 NS, owner path against the gather-everything fallback: the same gradients and the same
            # gathered NS input on the owner, so the same result up to kernel-batching noise (measured: 0.0).
            torch.testing.assert_close(got[r]["fsdp_auto_bfloat16"][name], got[r]["fsdp_local_bfloat16"][name],
                                       rtol=0, atol=1e-6)
    for mode in ("auto_float32", "auto_bfloat16"):
        counts = [got[r][f"fsdp_{mode}_counts"] for r in range(world)]
        assert [sum(c[s] for c in counts) for s in range(2)] == [TINY_MATRICES] * 2  # no matrix twice
        assert all(c[0] < TINY_MATRICES for c in counts)
    assert all(got[r]["fsdp_local_bfloat16_counts"] == [TINY_MATRICES] * 2 for r in range(world))  # repeats

    # One host read per step on every rank and every path (each has Gram-path matrices: the checks of the
    # matrices other ranks orthogonalised arrive with their results).
    for r in range(world):
        assert got[r]["ddp_reads"] == got[r]["ddp_fix_reads"] == [1, 1]
        for mode in ("auto_float32", "auto_bfloat16", "local_bfloat16", "auto_float32_fix", "local_float32_fix"):
            assert got[r][f"fsdp_{mode}_reads"] == [1, 1], mode

    # Corrections. DDP: the owner recomputes O_gram - O_standard and broadcasts it, every rank applies it: the
    # single-process result bit for bit, each flagged matrix corrected once, by its owner.
    for r in range(world):
        for a, b in zip(got[r]["ddp_fix"], single_process["ddp_fix"]):
            assert torch.equal(a, b)
    assert sum(got[r]["ddp_fix_fallbacks"] for r in range(world)) == single_process["ddp_fallbacks"]
    # FSDP: the owner gets the inputs again and returns each rank its rows of the correction (auto); the
    # gathered fallback gathers again and every rank corrects (local). Against one process within the fp32
    # reduction noise above, and the two paths the same up to it.
    for r in range(world):
        for name, want in single_process["fsdp_fix"].items():
            for mode in ("auto_float32_fix", "local_float32_fix"):
                assert torch.equal(got[r][f"fsdp_{mode}"][name], got[0][f"fsdp_{mode}"][name]), (mode, name)
                torch.testing.assert_close(got[r][f"fsdp_{mode}"][name], want, rtol=0, atol=5e-6)
    fsdp_fallbacks = single_process["fsdp_fallbacks"]
    assert sum(got[r]["fsdp_auto_float32_fix_fallbacks"] for r in range(world)) == fsdp_fallbacks
    assert all(got[r]["fsdp_local_float32_fix_fallbacks"] == fsdp_fallbacks for r in range(world))


def test_chunk_sizes_follow_torch_chunk():
    """FSDP2's Shard(0) rows per rank (the owner assignment itself is tested in test_core_balance.py)."""
    assert chunk_sizes(7, 3) == [3, 3, 1] and chunk_sizes(4, 3) == [2, 2, 0] and chunk_sizes(2, 3) == [1, 1, 0]