"""Tree vs ring decoding over a sharded KV cache: latency per token, communication rounds and bytes.

The same sharded cache (``zaya.serve.tree``: contiguous slices of ``L`` cached positions, new tokens on the
last rank) decoded by each of ``METHODS``:

* ``tree``: per layer one MAX all-reduce of the log-sum-exp and one fused SUM all-reduce of [o * w, w];
* ``butterfly``: per layer one recursive-doubling exchange of the packed (o, lse) (log2 p send/recv rounds);
* ``ring``: ring attention, the paper's baseline: per layer the KV shards travel p - 1 rounds around the ring;
* ``ring-partials``: per layer p - 1 send/recv rounds passing the partial (o, lse) around the ring.

Model: a tiny-width, 2-layer CCA model (hidden 64, 8 query heads and 2 KV heads of 64, 2 small experts), so that a
decode step is mostly the attention over the cache. The caches are filled with random keys and values (no prefill:
only the decode step is timed) and the CCA state is the same on every rank. Per method, ``--steps`` decode steps
(the token's broadcast included, as ``tree_generate`` does) are timed from a barrier, and a run's time per token is
the slowest rank's; the figure is the median over ``--repeats`` runs, tree and ring alternating run by run. Each
rank runs with one thread. ``single`` is one process (one thread) decoding the whole cache without communication.

Rounds per token are what the decoder counted: ``collectives`` (calls and send/recv rounds, one after another),
``latency_steps`` (an all-reduce or broadcast over p ranks counted as ceil(log2 p) steps, as a tree runs it; gloo
on one host may use other algorithms) and ``kib_sent`` (what the last rank handed to the backend).

Run: ``PYTHONPATH=src python benchmarks/tree_decoding.py [--worlds 2 4] [--lengths 8192 16384 32768]
[--steps 16] [--repeats 5]``. One JSON line per (world, length, method) and one summary line per (world, length)
to stdout; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import quiet  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from zaya.config import ModelConfig
from zaya.distributed.runtime import Runtime, start
from zaya.serve.tree import METHODS, CommStats, ShardedDecoder, ShardedKeys

MERGING = [m for m in METHODS if m != "ring"]
"""The methods that merge partials (``ring`` moves the keys instead): the merge-only timing."""
from zaya.model import ZayaForCausalLM

CONFIG = dict(vocab_size=256, hidden_size=64, num_layers=2, num_query_heads=8, num_kv_heads=2, head_dim=64,
              num_experts=2, top_k=1, expert_hidden_size=32, router_hidden_size=16, max_seq_len=65536)


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model() -> ZayaForCausalLM:
    torch.manual_seed(0)
    return ZayaForCausalLM(ModelConfig(**CONFIG)).eval()


def filled_decoder(model, runtime, method: str, length: int, new_tokens: int) -> ShardedDecoder:
    """A decoder whose slice of ``length`` cached positions holds random keys/values (seeded by rank, so both
    methods see the same cache) and whose CCA state is the same on every rank."""
    decoder = ShardedDecoder(model, runtime, method)
    decoder.allocate(1, length, new_tokens)
    g = torch.Generator().manual_seed(1000 + runtime.rank)
    state = torch.Generator().manual_seed(7)
    for cache in decoder.state.caches:
        held = cache.shard.held
        cache.keys[:, :, :held] = torch.randn(cache.keys[:, :, :held].shape, generator=g)
        cache.values[:, :, :held] = torch.randn(cache.values[:, :, :held].shape, generator=g)
        cache.conv_state.copy_(torch.randn(cache.conv_state.shape, generator=state))
        cache.value_state.copy_(torch.randn(cache.value_state.shape, generator=state))
    return decoder


def time_steps(decoder: ShardedDecoder, runtime, steps: int) -> float:
    """Seconds per token over ``steps`` decode steps, the slowest rank's."""
    token = torch.zeros(1, dtype=torch.long, device=runtime.device)
    runtime.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        token = decoder.share(token)
        decoder.step(token)
    elapsed = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64, device=runtime.device)
    return runtime.all_reduce(elapsed, "max").item()


def merge_only(runtime, repeats: int, calls: int = 200) -> list[dict]:
    """The part that differs between the methods alone: one layer's merge of [1, 8, 1, 64] partials (what this
    model's decode step merges per layer), ``calls`` times from a barrier; microseconds per merge, the slowest
    rank's, median over ``repeats`` runs."""
    g = torch.Generator().manual_seed(runtime.rank)
    o = torch.randn(1, CONFIG["num_query_heads"], 1, CONFIG["head_dim"], generator=g)
    lse = torch.randn(1, CONFIG["num_query_heads"], 1, generator=g)
    shards = {m: ShardedKeys(runtime, [1] * runtime.world_size, m, CommStats()) for m in MERGING}
    times = {m: [] for m in MERGING}
    for shard in shards.values():
        shard.merge(o, lse)
    for _ in range(repeats):
        for method, shard in shards.items():
            runtime.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                shard.merge(o, lse)
            elapsed = torch.tensor([(time.perf_counter() - t0) / calls], dtype=torch.float64)
            times[method].append(runtime.all_reduce(elapsed, "max").item())
    return [dict(world=runtime.world_size, merge_only=True, method=m, us_per_layer_merge=1e6 * statistics.median(t),
                 us_runs=[round(1e6 * x, 1) for x in t],
                 collectives_per_layer=shards[m].stats.collectives / (calls * repeats + 1)) for m, t in times.items()]


def _worker(rank: int, world: int, port: int, lengths: list[int], steps: int, repeats: int, out) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    runtime = start(device="cpu")
    model = build_model()
    rows = []
    with torch.no_grad():
        for length in lengths:
            decoders = {m: filled_decoder(model, runtime, m, length, steps * (repeats + 1)) for m in METHODS}
            for decoder in decoders.values():  # warm-up run (allocations, first-call costs)
                time_steps(decoder, runtime, steps)
                decoder.stats.reset()
            times = {m: [] for m in METHODS}
            for _ in range(repeats):
                for method, decoder in decoders.items():
                    times[method].append(time_steps(decoder, runtime, steps))
            for method, decoder in decoders.items():
                s = decoder.stats
                rows.append(dict(world=world, cached_tokens=length, method=method,
                                 ms_per_token=1e3 * statistics.median(times[method]),
                                 ms_runs=[round(1e3 * t, 3) for t in times[method]],
                                 collectives_per_token=s.collectives / s.tokens,
                                 latency_steps_per_token=s.steps / s.tokens,
                                 kib_sent_per_token=s.bytes_sent / s.tokens / 1024))
            del decoders
        rows += merge_only(runtime, repeats)
    # the times are every rank's slowest; the bytes sent this rank's: report the last rank's (the longest shard)
    if rank == world - 1:
        out.put(rows)
    dist.destroy_process_group()


def single_process(lengths: list[int], steps: int, repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    model, runtime, rows = build_model(), Runtime(), []
    with torch.no_grad():
        for length in lengths:
            decoder = filled_decoder(model, runtime, "tree", length, steps * (repeats + 1))
            time_steps(decoder, runtime, steps)
            times = [time_steps(decoder, runtime, steps) for _ in range(repeats)]
            rows.append(dict(world=1, cached_tokens=length, method="single",
                             ms_per_token=1e3 * statistics.median(times), ms_runs=[round(1e3 * t, 3) for t in times],
                             collectives_per_token=0.0, latency_steps_per_token=0.0))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per method (median)")
    args = p.parse_args()
    say(f"machine: {os.cpu_count()} cores; waiting for a quiet machine: {quiet.wait_quiet(0.3, 30)}")
    t0 = time.time()
    rows = single_process(args.lengths, args.steps, args.repeats)
    ctx = mp.get_context("spawn")
    for world in args.worlds:
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args.lengths, args.steps, args.repeats, queue))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        rows += queue.get(timeout=1800)
        for proc in procs:
            proc.join()
        say(f"world {world} done ({time.time() - t0:.0f} s)")
    for row in rows:
        print(json.dumps(row), flush=True)
    by = {(r["world"], r["cached_tokens"], r["method"]): r for r in rows if "cached_tokens" in r}
    merges = {(r["world"], r["method"]): r["us_per_layer_merge"] for r in rows if "merge_only" in r}
    for world in args.worlds:
        for length in args.lengths:
            ms = {m: by[(world, length, m)]["ms_per_token"] for m in METHODS}
            print(json.dumps(dict(summary=True, world=world, cached_tokens=length,
                                  single_ms=round(by[(1, length, "single")]["ms_per_token"], 3),
                                  ms_per_token={m: round(t, 3) for m, t in ms.items()},
                                  speedup_vs_ring={m: round(ms["ring"] / t, 3) for m, t in ms.items()},
                                  speedup_vs_ring_partials={m: round(ms["ring-partials"] / t, 3)
                                                            for m, t in ms.items()},
                                  merge_us={m: round(merges[(world, m)], 1) for m in MERGING},
                                  collectives={m: by[(world, length, m)]["collectives_per_token"] for m in METHODS},
                                  kib_sent={m: round(by[(world, length, m)]["kib_sent_per_token"], 1)
                                            for m in METHODS})), flush=True)


if __name__ == "__main__":
    main()
