"""Bias balancing across ranks: f_e is computed over the global batch (counts all-reduced over gloo)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zaya.config import ModelConfig
from zaya.model import ZayaForCausalLM, update_balancing_biases

CFG = dict(vocab_size=32, hidden_size=16, num_layers=2, num_query_heads=2, num_kv_heads=2, head_dim=8,
           num_experts=4, expert_hidden_size=8, router_hidden_size=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, counts: torch.Tensor, result: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = ZayaForCausalLM(ModelConfig(**CFG))
        update_balancing_biases(model, counts[rank])
        result[rank] = torch.stack([b.moe.router.balancing_biases.clone() for b in model.blocks])
    finally:
        dist.destroy_process_group()


def test_balancing_uses_global_counts_on_every_rank():
    # Each rank alone is skewed in opposite directions; together they are balanced in layer 0.
    counts = torch.tensor([
        [[8, 0, 4, 4, 1], [5, 1, 1, 1, 0]],
        [[0, 8, 4, 4, 0], [5, 1, 1, 1, 0]],
    ])
    world = 2
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_worker, args=(world, free_port(), counts, result), nprocs=world, join=True)
        biases = [result[r] for r in range(world)]
    torch.testing.assert_close(biases[0], biases[1])  # every rank takes the same step
    torch.manual_seed(0)
    local = ZayaForCausalLM(ModelConfig(**CFG))
    update_balancing_biases(local, counts.sum(0))
    expected = torch.stack([b.moe.router.balancing_biases for b in local.blocks])
    torch.testing.assert_close(biases[0], expected)
    assert torch.equal(biases[0][0, :4], torch.zeros(4))  # globally balanced layer: no change
    assert biases[0][1, 0] < 0 < biases[0][1, 1]  # expert 0 overloaded in layer 1
