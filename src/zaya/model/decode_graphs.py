"""CUDA graphs for the slot decoder's compiled decode step (``zaya serve --compile`` on CUDA/ROCm).

At one token per row a decode step is hundreds of small kernels whose launches, not their work, take the time on a
GPU; a CUDA graph replays them all in one launch. A graph fixes its shapes and its memory addresses, so the step is
captured per bucket: the rows padded up to a power of two (at most the decoder's slots) and the attention span up
to a power of two (at least ``MIN_SPAN`` keys, at most the capacity), a few dozen graphs for a whole serving life
instead of one per (rows, span). The step's inputs are copied into static buffers; the padding is exact: padded
rows are idle rows (their KV write goes to the null block, their CCA state is kept, their logits are dropped), and
padded keys lie past every row's position, masked to -inf (weight exactly 0; their values are finite: blocks are
zeroed when handed out). Everything else a step reads or writes (the block pool, the block table, the CCA state,
the valid-key mask, the weights) already lives at fixed addresses in the decoder.

Chosen over ``torch.compile(mode="reduce-overhead")``: its graph trees record a graph for every new size (the span
grows by one every step) and skip graphs whose inputs are mutated, which the step's KV writes and CCA state are.

A graph is captured the first time its bucket is used, after a warm-up call on a side stream with every row idle
(it compiles the step for that shape and initialises the libraries' handles, and changes no sequence's state).
"""

from __future__ import annotations

from typing import Callable

import torch

MIN_SPAN = 64
"""The smallest attention span bucket (keys)."""
Step = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, bool], torch.Tensor]
"""The decode step: (tokens [n], positions [n], keys, idle [n], aligned) -> logits [n, V]."""


def bucket(size: int, least: int, most: int) -> int:
    """The smallest power of two >= ``size`` and ``least``, but at most ``most``."""
    return min(most, 1 << (max(size, least) - 1).bit_length())


def graphs_wanted(device: torch.device) -> bool:
    """Whether a compiled decode step on ``device`` runs under CUDA graphs: on CUDA and ROCm (whose HIP graphs torch
    exposes under the same name); on the CPU, where a launch costs little, the plain compiled step."""
    return device.type == "cuda"


class DecodeGraphs:
    """The decode step ``step`` captured in one CUDA graph per (rows, span) bucket, with its static inputs."""

    def __init__(self, step: Step, num_slots: int, capacity: int, device: torch.device) -> None:
        self.step, self.num_slots, self.capacity = step, num_slots, capacity
        self.tokens = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.idle = torch.ones(num_slots, dtype=torch.bool, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def pad(self, tokens: torch.Tensor, positions: torch.Tensor, keys: int,
            idle: torch.Tensor | None) -> tuple[int, int]:
        """Copy a step's inputs into the static buffers, padded to its bucket: rows past ``n`` idle at position 0.
        Returns the bucket (rows, span); ``self.step(self.tokens[:rows], self.positions[:rows], span,
        self.idle[:rows], False)[:n]`` is then the step's logits."""
        n = tokens.shape[0]
        rows, span = bucket(n, 1, self.num_slots), bucket(keys, MIN_SPAN, self.capacity)
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.tokens[n:rows] = 0
        self.positions[n:rows] = 0
        if idle is None:
            self.idle[:n] = False
        else:
            self.idle[:n].copy_(idle)
        self.idle[n:rows] = True
        return rows, span

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, keys: int,
                 idle: torch.Tensor | None) -> torch.Tensor:
        """The step's logits [n, V] through its bucket's graph (captured now if new); a copy, since the next replay
        overwrites the graph's output."""
        rows, span = self.pad(tokens, positions, keys, idle)
        graph, out = self.graphs.get((rows, span)) or self._capture(rows, span)
        graph.replay()
        return out[:tokens.shape[0]].clone()

    def _capture(self, rows: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inputs = (self.tokens[:rows], self.positions[:rows], span, self.idle[:rows], False)
        idle = self.idle[:rows].clone()
        self.idle[:rows] = True  # the warm-up's rows all idle: it writes only the null block and scratch column
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles for these shapes, initialises the libraries' handles
                self.step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.idle[:rows] = idle
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time: they share one pool
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads may use the device meanwhile (capture checks only this one)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.step(*inputs)
        self.graphs[rows, span] = graph, out
        return graph, out
