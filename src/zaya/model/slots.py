"""Slot-based decode state for many independent sequences, and the batched one-token decode step over them.

This is the model half of the serving engine (``zaya.serve.engine`` schedules requests onto slots; ``zaya.serve.generate``
runs on the same engine). A ``SlotDecoder`` holds the keys and values of every slot in one pool of fixed-size
blocks per layer (paged memory: a slot's block table maps its positions to pool rows, and blocks are handed out as
its tokens arrive, so memory follows the tokens in flight, not slots x context), and per slot the CCA convolution
and value-shift state. Blocks are host-side bookkeeping (``zaya.model.blocks``); a block that ends a cached prompt
prefix may be shared by several slots, with the CCA state after its last token kept beside it (prefix caching,
``zaya.serve.prefix_cache``).

Why slots rather than one ``DecodeState`` per batch: sequences join and leave between steps (continuous batching),
each at its own length. A prefill writes one slot (or a block of slots) through the ordinary cached forward, on a
``DecodeState`` whose CCA tensors are views into the slot buffers and whose pages write into the pool, in chunks
of any size. A decode step feeds one token to each of the rows ``[0, n)`` at that row's own position: RoPE, the KV
write and the attention mask are per row, so rows of different lengths share one forward. Rows in that range that
are not decoding (free, or half-way through a chunked prefill) are "idle": their KV write goes to the null block
that no row in use reads, and their CCA state is kept (``torch.where``), so a step never disturbs them.

The decode step is a leaner copy of the forward for one token per row, because at one token the time goes to
per-op overhead, not arithmetic: the four projections are one pre-packed GEMM (the forward concatenates the weights
on every call), and the two causal convolutions, applied to a window of ``reach + 1`` positions, are folded into one
grouped matmul (the forward's two ``conv1d`` calls cost ~0.2 ms each on a CPU for a single position). The folded
weights are exact algebra (a composition of two linear maps) and differ from the forward's only in fp32 rounding
order (~1e-6 on the logits; tested against the forward). The packed weights are taken when the decoder is built:
build a new one after changing the weights.

With ``compile``, the decode step runs under ``torch.compile`` with dynamic shapes (one graph for every attention
span, and a second once several rows decode: dynamo specialises a size of 1; inductor fuses the step's many small
element-wise ops): 1.8-1.9x the eager step at batch 1
on the tiny shape in fp32 on a CPU (benchmarks/serve.py --compile). Compiling takes minutes on a few CPU cores, so
callers turn it on where it pays (``zaya serve --compile``). On CUDA/ROCm the compiled step also runs under CUDA
graphs, one per bucket of rows and attention span (``zaya.model.decode_graphs``). A failed compile logs one warning
and the decoder steps eagerly from then on; a failed graph capture, compiled without graphs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch._dynamo.exc import TorchDynamoException

from zaya.core.compile import failure_cause, use_compile_cache
from zaya.core.errors import ConfigError
from zaya.core.units import format_bytes
from zaya.model.attention import AttentionCache
from zaya.model.blocks import BlockPool
from zaya.model.decode_graphs import DecodeGraphs, graphs_wanted
from zaya.model.layers import _rms_norm, apply_rotary
from zaya.model.moe import _grouped_mm
from zaya.model.zaya import DecodeState

log = logging.getLogger("zaya.model")
COMPILE_BACKEND = "inductor"
"""The ``torch.compile`` backend of a compiled decode step (tests swap in one that only traces)."""
CUDA_GRAPHS = True
"""Whether a compiled decode step on CUDA/ROCm runs under CUDA graphs (a benchmark turns it off to compare)."""


class SlotMemoryError(ConfigError):
    """A slot decoder whose memory (its KV block pool plus what every slot keeps) exceeds what the device has
    available: refused before anything is allocated (a ``max_seq_len`` of 2**40 in a config failed in
    ``torch.zeros``; one just small enough would have taken every free byte). ``what`` says what was asked and what
    is free; the message adds a fix a caller may replace with its own flags (``ConfigError(f"{exc.what}: FIX")``)."""

    def __init__(self, num_slots: int, capacity: int, needed: int, available: int, device: torch.device) -> None:
        self.num_slots, self.capacity, self.needed, self.available = num_slots, capacity, needed, available
        self.what = (f"{num_slots} slot(s) of {capacity:,} tokens need {needed:,} bytes ({format_bytes(needed)}) "
                     f"for their KV cache and CCA state, and {device} has {available:,} bytes "
                     f"({format_bytes(available)}) available")
        super().__init__(f"{self.what}: use fewer slots or a shorter context")


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can take: the free memory of a CUDA/ROCm device
    (``torch.cuda.mem_get_info``), the system's available memory for the CPU (``psutil``); None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        import psutil

        return psutil.virtual_memory().available
    return None


class _LayerWeights:
    """One block's attention weights in the shapes the decode step uses (see the module docstring)."""

    def __init__(self, block) -> None:
        att = block.attention
        self.hq, self.hk, self.hd = att.num_query_heads, att.num_kv_heads, att.head_dim
        self.cca = att.kind == "cca"
        with torch.no_grad():
            if self.cca:
                self.w = torch.cat((att.q_proj.weight, att.k_proj.weight, att.v_current_proj.weight,
                                    att.v_previous_proj.weight)).detach()
                self.vw = att.v_current_proj.out_features
                self.reach = att.conv_reach
                self.conv_w, self.conv_b = _fold_convolutions(att.conv_depthwise, att.conv_grouped)
                self.temperature = att.temperature.detach()
            else:
                self.w = torch.cat((att.q_proj.weight, att.k_proj.weight, att.v_proj.weight)).detach()
        self.o = att.o_proj.weight


def _fold_convolutions(depthwise: torch.nn.Conv1d, grouped: torch.nn.Conv1d) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise (kernel k0) then grouped (kernel k1) causal convolutions at the last position of a window of
    k0 + k1 - 1 raw positions, as one linear map: weight [G, Cg * W, Cg] (group, (input channel, window position),
    output channel) and bias [C]."""
    wd = depthwise.weight[:, 0].double()  # [C, k0]
    wg = grouped.weight.double()  # [C, Cg, k1]
    c, cg, k1 = wg.shape
    k0 = wd.shape[1]
    window = k0 + k1 - 1
    groups = c // cg
    # input channel of each (output channel, local input channel): its group's channels
    cin = (torch.arange(c)[:, None] // cg) * cg + torch.arange(cg)[None, :]  # [C, Cg]
    wd_in = wd[cin]  # [C, Cg, k0]
    folded = torch.zeros(c, cg, window, dtype=torch.float64)
    for j in range(k1):  # grouped tap j reads depthwise output j, which reads window positions j .. j + k0 - 1
        folded[:, :, j:j + k0] += wg[:, :, j:j + 1] * wd_in
    bias = grouped.bias.double() + (wg.sum(-1) * depthwise.bias.double()[cin]).sum(-1)
    # [C_out, Cg_in, W] -> [G, Cg_in * W, Cg_out]
    weight = folded.view(groups, cg, cg, window).permute(0, 2, 3, 1).reshape(groups, cg * window, cg)
    dtype = grouped.weight.dtype
    return weight.to(dtype).contiguous(), bias.to(dtype)


def _moe_step(moe, h: torch.Tensor, latent: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MoE block for one token per row, ``h`` [n, D]: the router as in the forward, then the experts with
    grouped matmuls called directly (the forward's autograd wrappers and its training-only masks cost more than the
    matmuls at a handful of rows). Falls back to the forward's experts where grouped_mm does not apply."""
    routing = moe.router(h, latent)
    experts = moe.experts
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
    if not experts._use_grouped_mm(h, dtype):
        return experts(h, routing.experts, routing.weights), routing.latent
    n, k = routing.experts.shape
    e = experts.num_experts
    flat = routing.experts.reshape(-1)
    counts = torch.zeros(e + 1, dtype=torch.int64, device=h.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = counts[:e].cumsum(0).to(torch.int32)
    order = torch.argsort(flat, stable=True)
    xs = h.index_select(0, order // k if k > 1 else order).to(dtype)
    gate_up = _grouped_mm(xs, experts.gate_up_proj.to(dtype).transpose(-2, -1), offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    y = _grouped_mm(F.silu(gate) * up, experts.down_proj.to(dtype).transpose(-2, -1), offsets)
    weights = routing.weights.reshape(-1).to(dtype)
    if experts.has_skip:  # rows past the last offset are uninitialised: the skipped assignments (weight 0)
        y = y.masked_fill((torch.arange(flat.numel(), device=h.device) >= offsets[-1])[:, None], 0)
    out = torch.empty_like(y).index_copy_(0, order, y).mul_(weights[:, None])
    return (out.view(n, k, -1).sum(1) if k > 1 else out), routing.latent


def _single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention of one query per row, ``q`` [n, Hq, D], over ``k``/``v`` [n, Hkv, S, D] with GQA;
    ``bias`` [n, 1, 1, S] fp32, additive (0 or -inf), or None. Returns [n, Hq * D]. Two batched matmuls and a
    softmax in fp32 (as SDPA's kernels take it for bf16 inputs): SDPA's CPU kernel is built for long queries and took
    217 us against the matmuls' 162 us for one call at batch 8 and 600 keys (fp32, one thread); the tiny shape's
    decode step at batch 8 went from 6.28 to 6.05 ms (medians of 5, the two in one process)."""
    n, hq, d = q.shape
    hk = k.shape[1]
    scores = torch.matmul((q * d**-0.5).view(n, hk, hq // hk, d), k.transpose(-1, -2)).float()  # [n, Hkv, G, S]
    if bias is not None:
        scores = scores + bias
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v).view(n, hq * d)


class _LayerPages:
    """One layer's share of the block pool: keys and values [num_blocks * block_size, Hkv, D] (row
    ``block * block_size + offset``), and with prefix states the CCA state after each block's last token
    (``conv`` [num_blocks, C, reach], ``value`` [num_blocks, W])."""

    def __init__(self, attention, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 prefix_states: bool) -> None:
        rows = (num_blocks * block_size, attention.num_kv_heads, attention.head_dim)
        # empty, not zeros: a CPU process touches (and keeps resident) only the blocks it writes; every block is
        # zeroed when it is handed out (SlotDecoder.ensure), the null block here
        self.keys = torch.empty(rows, dtype=dtype, device=device)
        self.values = torch.empty(rows, dtype=dtype, device=device)
        self.keys[:block_size] = 0
        self.values[:block_size] = 0
        self.conv = self.value = None
        if prefix_states and attention.kind == "cca":
            self.conv = torch.empty(num_blocks, attention.conv_depthwise.in_channels, attention.conv_reach,
                                    dtype=dtype, device=device)
            self.value = torch.empty(num_blocks, attention.v_previous_proj.out_features, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(attention, block_size: int, dtype: torch.dtype, prefix_states: bool) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        total = 2 * block_size * attention.num_kv_heads * attention.head_dim
        if prefix_states and attention.kind == "cca":
            total += attention.conv_depthwise.in_channels * attention.conv_reach + attention.v_previous_proj.out_features
        return total * size


class _SlotPages:
    """``KeyPages`` (``zaya.model.attention``) of one layer for slots ``[slot, slot + count)``: positions map to
    pool rows through the slots' block tables."""

    def __init__(self, layer: _LayerPages, table: torch.Tensor, block_size: int) -> None:
        self.layer, self.table, self.block_size = layer, table, block_size

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Pool rows [count, len(positions)] of ``positions`` in each slot."""
        bs = self.block_size
        return self.table[:, positions // bs] * bs + positions % bs

    def write_read(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        count, hk, t, d = k.shape
        rows = self.rows(torch.arange(start + t, device=k.device))  # [count, start + t]
        new = rows[:, start:].reshape(-1)
        layer = self.layer
        layer.keys[new] = k.transpose(1, 2).reshape(-1, hk, d).to(layer.keys.dtype)
        layer.values[new] = v.transpose(1, 2).reshape(-1, hk, d).to(layer.values.dtype)
        return layer.keys[rows].transpose(1, 2), layer.values[rows].transpose(1, 2)

    def save_state(self, window: torch.Tensor, delayed: torch.Tensor, start: int) -> None:
        layer = self.layer
        if layer.conv is None:
            return
        bs, reach, t = self.block_size, layer.conv.shape[-1], delayed.shape[1]
        # the state after position e - 1, for every block end e in (start, start + t]
        first = (start // bs + 1) * bs
        if first > start + t:
            return
        ends = torch.arange(first, start + t + 1, bs, device=window.device)
        blocks = self.table[:, ends // bs - 1].reshape(-1)  # [count * ends]
        at = ends - start  # window column j holds position start - reach + j: the state after e - 1 is [at, at + reach)
        conv = window[:, :, at[:, None] + torch.arange(reach, device=window.device)]  # [count, C, ends, reach]
        layer.conv[blocks] = conv.permute(0, 2, 1, 3).reshape(-1, *layer.conv.shape[1:]).to(layer.conv.dtype)
        layer.value[blocks] = delayed[:, at - 1].reshape(-1, layer.value.shape[-1]).to(layer.value.dtype)


class SlotDecoder:
    """KV cache + CCA state for ``num_slots`` sequences of up to ``capacity`` tokens, and the operations the
    engine needs on them: ``reset`` a slot, ``ensure`` it has blocks for a length, ``attach`` cached prefix blocks,
    ``prefill`` tokens into a slot (or a block of slots), ``step`` one token per row. Lengths are the caller's to
    track (on the host: they advance by known amounts, so no read is needed).

    Paged memory: keys and values live in a pool of ``num_blocks`` blocks of ``block_size`` tokens shared by all
    slots (default: enough for every slot's whole capacity); a slot's block table maps its positions to pool rows,
    and blocks are handed out as its tokens arrive (``ensure``; ``prefill`` does it itself). ``prefix_states``
    also keeps, per block, the CCA convolution and value-shift state after its last token, so that a later
    sequence can start from a cached prefix (``attach``). Per slot there is only the block table, the running CCA
    state and a valid-key mask. Block 0 is the null block (``zaya.model.blocks``)."""

    def __init__(self, model, num_slots: int, capacity: int, dtype: torch.dtype | None = None,
                 block_size: int = 16, num_blocks: int | None = None, prefix_states: bool = False,
                 compile: bool = False) -> None:
        if num_slots < 1 or capacity < 1 or block_size < 1:
            raise ValueError(f"a slot decoder needs at least one slot, position and token per block, got {num_slots} "
                             f"slots of {capacity} in blocks of {block_size}")
        self.model = model
        self.num_slots = num_slots
        self.capacity = capacity
        self.block_size = block_size
        self.blocks_per_slot = -(-capacity // block_size)
        self.num_blocks = num_blocks or self.num_slots * self.blocks_per_slot + 1
        if self.num_blocks < 2:
            raise ValueError(f"a slot decoder needs at least 2 blocks (one is the null block), not {self.num_blocks}")
        self.prefix_states = prefix_states
        device = model.embed.weight.device
        dtype = dtype or model.embed.weight.dtype
        needed = self.bytes_needed(model, num_slots, capacity, dtype, block_size, self.num_blocks, prefix_states)
        available = available_memory(device)
        if available is not None and needed > available:
            raise SlotMemoryError(num_slots, capacity, needed, available, device)
        self.pool = BlockPool(self.num_blocks)
        self.slot_blocks: list[list[int]] = [[] for _ in range(num_slots)]
        """The blocks each slot holds, in position order (host copy of the block table's used columns)."""
        self.table = torch.zeros(num_slots, self.blocks_per_slot, dtype=torch.int64, device=device)
        self.pages = [_LayerPages(block.attention, self.num_blocks, block_size, dtype, device, prefix_states)
                      for block in model.blocks]
        # the running CCA state of every slot, and which positions hold a key (one scratch column past the
        # capacity: idle rows of a decode step mark it)
        self.caches = [AttentionCache(keys=None, values=None, **b.attention.new_cca_state(num_slots, dtype, device))
                       for b in model.blocks]
        self.key_valid = torch.zeros(num_slots, capacity + 1, dtype=torch.bool, device=device)
        self.layers = [_LayerWeights(block) for block in model.blocks]
        self.device = device
        self._rows = torch.arange(num_slots, device=self.device)
        self._key_index = torch.arange(capacity + 1, device=self.device)
        # dynamic: the attention span grows by one every step and the rows in a step vary; a graph serves them all
        self._compiled = self._graphs = None
        if compile:
            use_compile_cache()
            self._compiled = torch.compile(self._step, dynamic=True, backend=COMPILE_BACKEND)
            if CUDA_GRAPHS and graphs_wanted(device):
                self._graphs = DecodeGraphs(self._compiled, num_slots, capacity, device)

    @staticmethod
    def bytes_needed(model, num_slots: int, capacity: int, dtype: torch.dtype | None = None, block_size: int = 16,
                     num_blocks: int | None = None, prefix_states: bool = False) -> int:
        """Bytes a decoder allocates when it is built (its pool as if every block were written): the block pool of
        every layer (``num_blocks``, default enough for every slot's capacity), and per slot the block table, the
        CCA state and the valid-key mask, and the key index (taken from the layers' own shapes; nothing is
        allocated)."""
        dtype = dtype or model.embed.weight.dtype
        blocks_per_slot = -(-capacity // block_size)
        num_blocks = num_blocks or num_slots * blocks_per_slot + 1
        columns = capacity + 1
        total = num_slots * columns + 8 * columns + 8 * num_slots * blocks_per_slot  # mask, key index, table
        total += num_blocks * SlotDecoder.block_bytes(model, block_size, dtype, prefix_states)
        for block in model.blocks:
            total += sum(t.numel() * t.element_size()
                         for t in block.attention.new_cca_state(num_slots, dtype, torch.device("meta")).values())
        return total

    @staticmethod
    def block_bytes(model, block_size: int = 16, dtype: torch.dtype | None = None,
                    prefix_states: bool = False) -> int:
        """Bytes one block of the pool takes, over every layer."""
        dtype = dtype or model.embed.weight.dtype
        return sum(_LayerPages.bytes_per_block(b.attention, block_size, dtype, prefix_states) for b in model.blocks)

    # ------------------------------------------------------------------------------------------- slots
    def reset(self, slot: int, count: int = 1) -> None:
        """Make slots ``[slot, slot + count)`` empty (a new sequence starts there): their blocks released, CCA
        state zero, no valid key."""
        for s in range(slot, slot + count):
            self.release(s)
        self.key_valid[slot:slot + count] = False
        for cache in self.caches:
            if cache.conv_state is not None:
                cache.conv_state[slot:slot + count] = 0
                cache.value_state[slot:slot + count] = 0

    def release(self, slot: int) -> None:
        """Give back every block ``slot`` holds (its table then points at the null block)."""
        held = self.slot_blocks[slot]
        for block in held:
            self.pool.release(block)
        if held:
            self.table[slot, :len(held)] = 0
        self.slot_blocks[slot] = []

    def ensure(self, slot: int, length: int) -> None:
        """Hand ``slot`` new blocks until it covers positions ``[0, length)`` (``OutOfBlocksError`` when the pool
        is exhausted: the caller's admission keeps that from happening). New blocks are zeroed, so that positions
        not yet written hold finite numbers (a masked key then adds nothing, not NaN)."""
        held = self.slot_blocks[slot]
        need = -(-length // self.block_size)
        if need > self.blocks_per_slot:
            raise ValueError(f"slot holds {self.capacity} positions; {length} requested")
        if need <= len(held):
            return
        new = [self.pool.allocate() for _ in range(need - len(held))]
        rows = (torch.tensor(new, device=self.device)[:, None] * self.block_size
                + torch.arange(self.block_size, device=self.device)).reshape(-1)
        for layer in self.pages:
            layer.keys.index_fill_(0, rows, 0)
            layer.values.index_fill_(0, rows, 0)
        self.table[slot, len(held):need] = torch.tensor(new, device=self.device)
        held.extend(new)

    def attach(self, slot: int, blocks: list[int]) -> None:
        """Start empty ``slot`` from a cached prefix: hold ``blocks`` (registered blocks of that prefix, in order),
        mark their positions valid and take the CCA state kept after the last one (needs ``prefix_states``)."""
        if self.slot_blocks[slot]:
            raise ValueError(f"slot {slot} holds blocks: reset it before attaching a prefix")
        if not blocks:
            return
        if not self.prefix_states:
            raise ValueError("attaching a cached prefix needs a decoder built with prefix_states=True")
        for block in blocks:
            self.pool.hold(block)
        self.slot_blocks[slot] = list(blocks)
        self.table[slot, :len(blocks)] = torch.tensor(blocks, device=self.device)
        self.key_valid[slot, :len(blocks) * self.block_size] = True
        last = blocks[-1]
        for cache, layer in zip(self.caches, self.pages):
            if layer.conv is not None:
                cache.conv_state[slot] = layer.conv[last]
                cache.value_state[slot] = layer.value[last]

    def view(self, slot: int, count: int, length: int):
        """A ``DecodeState`` over slots ``[slot, slot + count)`` holding ``length`` tokens each, whose tensors are
        views into this decoder's buffers (its pages map positions through the slots' block tables): the model's
        cached forward writes straight into the pool."""
        rows = slice(slot, slot + count)
        table = self.table[rows]
        caches = [AttentionCache(keys=None, values=None,
                                 conv_state=None if c.conv_state is None else c.conv_state[rows],
                                 value_state=None if c.value_state is None else c.value_state[rows],
                                 pages=_SlotPages(layer, table, self.block_size))
                  for c, layer in zip(self.caches, self.pages)]
        return DecodeState(caches=caches, key_valid=self.key_valid[rows, :self.capacity], length=length)

    @torch.no_grad()
    def prefill(self, slot: int, ids: torch.Tensor, start: int, all_logits: bool = False,
                chunk: int | None = None) -> torch.Tensor:
        """Feed ``ids`` [count, T] (or [T] for one slot) to slots ``[slot, slot + count)`` after ``start`` cached
        tokens, in chunks of ``chunk`` tokens (default: all at once), handing the slots the blocks they need.
        Returns the logits [count, T, V] of every position when ``all_logits`` (prompt log-probabilities), else of
        the last position [count, V]."""
        if ids.dim() == 1:
            ids = ids[None]
        count, t = ids.shape
        if start + t > self.capacity:
            raise ValueError(f"slot holds {self.capacity} positions; {start} used, {t} more requested")
        for s in range(slot, slot + count):
            self.ensure(s, start + t)
        state = self.view(slot, count, start)
        chunk = chunk or t
        pieces = []
        for a in range(0, t, chunk):
            piece = ids[:, a:a + chunk]
            last = a + chunk >= t
            out = self.model(piece, state=state, logits_to_keep=0 if all_logits else 1).logits
            if all_logits:
                pieces.append(out)
            elif last:
                pieces.append(out[:, -1])
        return torch.cat(pieces, dim=1) if all_logits else pieces[0]

    # ------------------------------------------------------------------------------------------- decode step
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, keys: int,
             idle: torch.Tensor | None = None, aligned: bool = False) -> torch.Tensor:
        """One token for each row ``[0, n)``: ``tokens`` [n], ``positions`` [n] (each row's cached length: where its
        token goes), ``keys`` = 1 + the largest position of a decoding row (the attention span), ``idle`` [n] bool
        (rows that are not decoding, or None); ``aligned``: every row is at position ``keys - 1`` (a fixed batch
        without padding), so attention needs no mask. Returns the next-token logits [n, V]; advances no length.
        Every decoding row's blocks must cover its position (``ensure``). Runs compiled when the decoder was built
        with ``compile``, under CUDA graphs on CUDA/ROCm."""
        if keys > self.capacity:
            raise ValueError(f"slot holds {self.capacity} positions; a step needs {keys}")
        if self._graphs is not None:
            try:
                return self._graphs(tokens, positions, keys, idle)
            except Exception as err:  # noqa: BLE001 - compiling or capturing failed: compiled (or eager) without graphs
                log.warning("running the decode step in CUDA graphs failed (%s); decoding without them",
                            failure_cause(err))
                self._graphs = None
        if self._compiled is not None:
            try:
                return self._compiled(tokens, positions, keys, idle, aligned)
            except TorchDynamoException as err:  # compiling failed (dynamo or its backend): eager from now on
                log.warning("compiling the decode step failed (%s); decoding eagerly", failure_cause(err))
                self._compiled = None
        return self._step(tokens, positions, keys, idle, aligned)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, keys: int, idle: torch.Tensor | None,
              aligned: bool) -> torch.Tensor:
        model = self.model
        n = tokens.shape[0]
        write = positions if idle is None else torch.where(idle, self.capacity, positions)
        # the keys this step writes are valid for a later multi-token forward (prefill after decoding, speculation);
        # idle rows mark the scratch column, which no view includes
        self.key_valid[self._rows[:n], write] = True
        rows = self._rows[:n]
        bs = self.block_size
        own = self.table[rows, positions // bs]  # each row's block for its position (idle rows: not written)
        pool_write = own * bs + positions % bs
        if idle is not None:  # idle rows write into the null block, which no table entry in use points at
            pool_write = torch.where(idle, 0, pool_write)
        key_positions = self._key_index[:keys]
        pool_read = self.table[:n, key_positions // bs] * bs + key_positions % bs  # [n, keys]
        ending = None
        if self.prefix_states:  # rows whose token ends a block keep their CCA state with it (idle rows: null block)
            ends = (positions + 1) % bs == 0
            ending = torch.where(ends if idle is None else ends & ~idle, own, 0)
        # may attend: keys up to the row's own position (idle rows: anything; their output is unused)
        mask = None
        if not aligned or idle is not None:
            allowed = self._key_index[None, :keys] <= positions[:, None]
            mask = torch.zeros(allowed.shape, dtype=torch.float32, device=self.device).masked_fill_(
                ~allowed, float("-inf"))[:, None, None]
        cos, sin = model.rope.cos_sin(positions[:, None])  # [n, 1, 1, rot]
        x = model.input_affine(model.embed(tokens))
        x = x.float() if model.config.residual_fp32 else x
        keep = None if idle is None else idle[:, None]
        latent = None
        for block, weights, cache, pages in zip(model.blocks, self.layers, self.caches, self.pages):
            h = _rms_norm(x.to(block.attn_norm.weight.dtype), block.attn_norm.weight, block.attn_norm.eps)[0]
            a = self._attend(h, weights, cache, pages, cos, sin, mask, pool_write, pool_read, keep, ending)
            x = block._join(block.attn_residual(a, x))
            h = _rms_norm(x.to(block.moe_norm.weight.dtype), block.moe_norm.weight, block.moe_norm.eps)[0]
            m, latent = _moe_step(block.moe, h, latent)
            x = block._join(block.moe_residual(m, x))
        h = model.final_norm(x.to(model.final_norm.weight.dtype))
        return F.linear(h, model.head_weight())

    def _attend(self, h, w: _LayerWeights, cache: AttentionCache, pages: _LayerPages, cos, sin, mask, pool_write,
                pool_read, keep, ending):
        n = h.shape[0]
        hq, hk, hd = w.hq, w.hk, w.hd
        qw, kw = hq * hd, hk * hd
        proj = F.linear(h, w.w.to(h.dtype))
        if w.cca:
            qk, v_current, v_delayed = proj.split((qw + kw, w.vw, w.vw), dim=-1)
            q_mean = (qk[:, :qw].view(n, hk, hq // hk, hd) + qk[:, qw:].view(n, hk, 1, hd)) * 0.5
            k_mean = q_mean.mean(dim=2)
            conv_state = cache.conv_state[:n]
            window = torch.cat((conv_state.to(qk.dtype), qk[:, :, None]), dim=-1)  # [n, C, reach + 1]
            groups = w.conv_w.shape[0]
            grouped = window.view(n, groups, -1).transpose(0, 1)  # [G, n, Cg * W]
            mixed = torch.bmm(grouped, w.conv_w.to(qk.dtype)).transpose(0, 1).reshape(n, -1) + w.conv_b.to(qk.dtype)
            q = mixed[:, :qw].view(n, hq, hd) + q_mean.reshape(n, hq, hd)
            k = mixed[:, qw:].view(n, hk, hd) + k_mean
            previous = cache.value_state[:n]
            v = torch.cat((v_current, previous.to(v_current.dtype)), dim=-1).view(n, hk, hd)
            new_conv, new_value = window[..., 1:], v_delayed
            if keep is not None:
                new_conv = torch.where(keep[:, :, None], conv_state, new_conv)
                new_value = torch.where(keep, previous, new_value)
            conv_state.copy_(new_conv)
            previous.copy_(new_value)
            if ending is not None:
                pages.conv.index_copy_(0, ending, new_conv.to(pages.conv.dtype))
                pages.value.index_copy_(0, ending, new_value.to(pages.value.dtype))
            eps = torch.finfo(q.dtype).eps
            scale = hd**0.5
            dtype = q.dtype
            q = (q * (scale / q.norm(dim=-1, keepdim=True).clamp_min(eps))).to(dtype)
            k = (k * (scale / k.norm(dim=-1, keepdim=True).clamp_min(eps)) * w.temperature.to(dtype)[:, None]
                 ).to(dtype)
        else:
            q, k, v = proj.split((qw, kw, kw), dim=-1)
            q, k, v = q.view(n, hq, hd), k.view(n, hk, hd), v.view(n, hk, hd)
        q = apply_rotary(q[:, :, None], cos, sin)[:, :, 0]  # [n, Hq, D]
        k = apply_rotary(k[:, :, None], cos, sin)[:, :, 0]  # [n, Hkv, D]
        pages.keys[pool_write] = k.to(pages.keys.dtype)
        pages.values[pool_write] = v.to(pages.values.dtype)
        kk = pages.keys[pool_read].transpose(1, 2).to(q.dtype)  # [n, Hkv, keys, D]
        vv = pages.values[pool_read].transpose(1, 2).to(q.dtype)
        out = _single_query_attention(q, kk, vv, mask)
        return F.linear(out, w.o.to(out.dtype))
