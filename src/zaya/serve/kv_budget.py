"""How many KV blocks the serving engine's pool gets (``zaya serve --kv-cache-memory``).

The pool is shared by all sequences and filled as tokens arrive (``zaya.model.slots``); its size bounds the tokens
in flight, not the context of one sequence (``--max-model-len``) or the number of sequences (``--max-num-seqs``).
By default it holds every sequence's whole context when that fits in 90% of the memory available after the
per-sequence tables, and what fits otherwise: a long-context config then serves as many tokens at once as the
machine holds, and a request that needs more blocks than the whole pool is refused with the number it needs.
On a CPU the pool's memory becomes resident only as blocks are written; on a GPU it is reserved when the server
starts (as vLLM reserves its KV cache).
"""

from __future__ import annotations

import torch

from zaya.core.errors import ConfigError
from zaya.core.units import format_bytes
from zaya.model.slots import SlotDecoder, available_memory

AUTO_FRACTION = 0.9
"""Of the memory available after the per-sequence tables, the share the default pool may take."""


def kv_blocks(model, num_seqs: int, max_model_len: int, block_size: int, memory: int | None,
              prefix_caching: bool, dtype: torch.dtype | None = None) -> int:
    """Blocks (the null block included) for a pool of ``memory`` bytes (None: the default above), never more than
    every sequence's whole context needs. ``ConfigError`` when ``memory`` holds no block."""
    per_block = SlotDecoder.block_bytes(model, block_size, dtype, prefix_caching)
    full = num_seqs * -(-max_model_len // block_size) + 1
    if memory is not None:
        blocks = memory // per_block
        if blocks < 2:
            raise ConfigError(f"--kv-cache-memory {memory:,} bytes holds {blocks} KV block(s) of {block_size} tokens "
                              f"({per_block:,} bytes each, one is reserved): give at least {2 * per_block:,} bytes")
        return min(blocks, full)
    available = available_memory(model.embed.weight.device)
    if available is None:
        return full
    fixed = SlotDecoder.bytes_needed(model, num_seqs, max_model_len, dtype, block_size, 2, prefix_caching)
    fits = int(AUTO_FRACTION * (available - fixed)) // per_block
    return max(2, min(full, fits))  # too little memory even for 2 blocks: the decoder's own check says so


def describe(num_blocks: int, block_size: int, model, prefix_caching: bool, dtype: torch.dtype | None = None) -> str:
    """"N blocks of B tokens (T tokens, SIZE)" for the server's start line."""
    usable = num_blocks - 1
    size = num_blocks * SlotDecoder.block_bytes(model, block_size, dtype, prefix_caching)
    return f"{usable:,} KV blocks of {block_size} tokens ({usable * block_size:,} tokens, {format_bytes(size)})"
