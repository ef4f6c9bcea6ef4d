"""GPU suite check ``decode``: the serving engine's decode tokens/s and a cached prefix's time to first token.

A ``ZayaForCausalLM`` with configs/zaya1-base.toml's [model] and 4 layers (the full vocabulary), random weights in
bf16 on the GPU (fp32 in the CPU smoke mode, on the smoke model), served by ``zaya.serve.engine.Engine`` as
``zaya serve`` serves: batch 1 and 16 requests of a 128-token random prompt, greedy, ``max_tokens`` new tokens
each (eos ignored), eager, with the decode step compiled (``Engine(compile=True)``: ``torch.compile`` of the
slot decoder's step, dynamic shapes; CUDA graphs off) and, on a GPU, compiled under CUDA graphs (``zaya serve
--compile``'s default there: ``zaya.model.decode_graphs``). Each (mode, batch) runs once untimed (the compiled ones
compile, and capture their graphs, there: that time less the timed run's is ``compile_s``), then once timed:
``tokens_per_s`` counts the tokens decoded after every request's first token, over the time from that first token
to the last (prefill excluded). ``greedy_agreement`` is the share of a mode's greedy tokens equal to the eager
engine's, ``agreement_with_compiled`` the graphs' with the compiled engine's (reported, not required: random weights
give near-tied logits, which bf16 rounding in another order, or a padded row or span, may flip).

Then prefix caching: a request whose first 1,024 tokens an earlier request computed, on an engine with prefix
caching against one without (eager, median of 3, a fresh 32-token suffix each time): ``ttft_cached_ms`` and
``ttft_cold_ms``. The smoke mode compiles with the "eager" backend (dynamo's trace alone: inductor's C++ build, or
even AOTAutograd's, takes minutes there) and at batch 1 only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from gpu_common import Ctx, median, rnd, say
from gpu_model_step import base_config


def check_decode(ctx: Ctx, r: dict[str, Any]) -> None:
    torch = ctx.torch
    import zaya.model.slots as slots
    from zaya.model import ZayaForCausalLM
    from zaya.serve.engine import Engine
    from zaya.serve.request import Request
    from zaya.serve.sampling import SamplingParams

    cfg = base_config(ctx)
    if ctx.level == "smoke":
        slots.COMPILE_BACKEND = "eager"
    prompt_len, new, prefix, suffix = 128, ctx.pick(128, 32, 8), ctx.pick(1024, 1024, 64), 32
    cfg = dataclasses.replace(cfg, num_layers=ctx.pick(4, 2, 2), max_seq_len=prefix + suffix + prompt_len + new + 64)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    r.update(layers=cfg.num_layers, vocab_size=cfg.vocab_size, dtype=str(dtype).replace("torch.", ""),
             prompt_tokens=prompt_len, new_tokens=new, compile_backend=slots.COMPILE_BACKEND)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = ZayaForCausalLM(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(16)]
    greedy = SamplingParams(temperature=0)

    def run(engine: Engine, batch: int) -> tuple[float, float, list[list[int]]]:
        """(seconds to every first token, decode tokens/s after it, the outputs)."""
        reqs = [engine.submit(Request(prompt=p, max_tokens=new, ignore_eos=True, sampling=greedy))
                for p in prompts[:batch]]
        t0 = time.perf_counter()
        while not all(q.output for q in reqs):
            engine.step()
        t1 = time.perf_counter()
        while not all(q.finished for q in reqs):
            engine.step()
        t2 = time.perf_counter()
        return t1 - t0, batch * (new - 1) / (t2 - t1), [q.output for q in reqs]

    outputs: dict[str, dict[int, list[list[int]]]] = {}
    for mode in ("eager", "compiled", "graphs") if ctx.cuda else ("eager", "compiled"):
        slots.CUDA_GRAPHS = mode == "graphs"
        engine = Engine(model, num_slots=16, capacity=prompt_len + new + 8, compile=mode != "eager")
        part = r[mode] = {}
        outputs[mode] = {}
        for batch in ((1,) if mode == "compiled" and ctx.level == "smoke" else (1, 16)):
            if ctx.remaining() < 30:
                part[f"batch_{batch}"] = {"skipped": "no time left in the check's budget"}
                continue
            say(f"decode: {mode}, batch {batch}")
            t0 = time.perf_counter()
            run(engine, batch)  # untimed: kernels' first calls, the compile
            first_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            ttft_s, tok_s, outs = run(engine, batch)
            res = {"tokens_per_s": rnd(tok_s), "ttft_ms": rnd(ttft_s * 1e3)}
            outputs[mode][batch] = outs
            if mode != "eager":
                res["compile_s"] = rnd(first_s - (time.perf_counter() - t0))
                res["greedy_agreement"] = agreement(outs, outputs["eager"].get(batch, []))
                res["compiled_in_use"] = engine.decoder._compiled is not None
            if mode == "graphs":
                res["agreement_with_compiled"] = agreement(outs, outputs["compiled"].get(batch, []))
                res["graphs_in_use"] = engine.decoder._graphs is not None
                res["graphs_captured"] = len(engine.decoder._graphs.graphs) if res["graphs_in_use"] else 0
            part[f"batch_{batch}"] = res
        if mode == "eager":
            r["tokens_per_s_batch_1"] = part.get("batch_1", {}).get("tokens_per_s")
            r["tokens_per_s_batch_16"] = part.get("batch_16", {}).get("tokens_per_s")
    slots.CUDA_GRAPHS = True
    for batch in (1, 16):
        e = r["eager"].get(f"batch_{batch}", {})
        for mode in ("compiled", "graphs"):
            c = r.get(mode, {}).get(f"batch_{batch}", {})
            if e.get("tokens_per_s") and c.get("tokens_per_s"):
                r[f"{mode}_speedup_batch_{batch}"] = rnd(c["tokens_per_s"] / e["tokens_per_s"], 3)

    # Prefix caching: the cached prefix's time to first token against computing it.
    shared = torch.randint(3, cfg.vocab_size, (prefix,), generator=g).tolist()
    cap = prefix + suffix + 8
    engines = {"cached": Engine(model, num_slots=1, capacity=cap),
               "cold": Engine(model, num_slots=1, capacity=cap, prefix_caching=False)}
    engines["cached"].run([Request(prompt=shared + [5] * suffix, max_tokens=1)])  # computes and caches the prefix
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(4):  # the first round warms up
        p = shared + torch.randint(3, cfg.vocab_size, (suffix,), generator=g).tolist()
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.run([Request(prompt=p, max_tokens=1, sampling=greedy)])
            times[name].append(time.perf_counter() - t0)
    e = engines["cached"]
    r.update(prefix_tokens=prefix, suffix_tokens=suffix,
             ttft_cached_ms=rnd(1e3 * median(times["cached"][1:])), ttft_cold_ms=rnd(1e3 * median(times["cold"][1:])),
             prefix_hit_rate=rnd(e.prefix_hits / max(1, e.prefix_queried), 3))
    r["prefix_speedup"] = rnd(r["ttft_cold_ms"] / r["ttft_cached_ms"], 3)
    compiled = [v for mode in ("compiled", "graphs") for v in r.get(mode, {}).values() if "tokens_per_s" in v]
    graphed = [v for v in r.get("graphs", {}).values() if "tokens_per_s" in v]
    r["ok"] = bool(compiled) and all(v["compiled_in_use"] for v in compiled) and all(v["graphs_in_use"]
                                                                                     for v in graphed)
    if not r["ok"]:
        r["error"] = ("the compiled decode step, or its CUDA graphs, did not run (compiling or capturing failed, or "
                      "no time was left)")


def agreement(outs: list[list[int]], reference: list[list[int]]) -> float:
    """The share of the tokens in ``outs`` equal to ``reference``'s at the same place."""
    pairs = [(a, b) for x, y in zip(outs, reference) for a, b in zip(x, y)]
    return rnd(sum(a == b for a, b in pairs) / max(1, len(pairs)), 3)
