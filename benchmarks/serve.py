"""Serving benchmarks: (1) greedy ``model.generate`` (the engine) against transformers' ``ZayaForCausalLM.generate``
on the tiny shape, same weights, same run, with outputs checked against the greedy argmax of one forward pass;
(2) a bounded loopback load test of ``zaya serve`` (a fixed number of streaming requests from a few concurrent
clients); (3) KV + CCA state bytes per token against an MHA model of the same width, from the configs;
(4) with ``--speculative``, only: prompt-lookup speculation at batch 1 against plain decoding (``bench_speculative``);
(5) with ``--prefix-cache``, only: time to first token with a 1,024-token prefix cached against not
(``bench_prefix_cache``); (6) with ``--memory``, only: resident memory of an idle and a busy engine of 16 sequences
of 131,072 positions against the weights (``bench_memory``); (7) with ``--compile``, only: the decode step at batch 1
compiled against eager (``bench_compiled_decode``).

Run: ``PYTHONPATH=src python benchmarks/serve.py [--threads 1] [--skip-load] [--quick] [--speculative |
--prefix-cache | --memory | --compile]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch


def build_models(max_seq_len: int):
    from transformers import ZayaConfig
    from transformers import ZayaForCausalLM as HF

    from zaya.config import load_config
    from zaya.model import ZayaForCausalLM
    from zaya.model.hf import hf_config_from_model_config, hf_state_dict

    torch.manual_seed(0)
    cfg = load_config("configs/tiny.toml").model
    cfg = type(cfg)(**{**cfg.__dict__, "max_seq_len": max_seq_len})
    model = ZayaForCausalLM(cfg).eval()
    with torch.no_grad():  # off the init (so that routing and tokens vary), same weights for both
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    hc = ZayaConfig(**hf_config_from_model_config(cfg))
    hc._attn_implementation = "sdpa"
    hf = HF(hc).eval()
    hf.load_state_dict(hf_state_dict(model), strict=False)
    hf.tie_weights()
    with torch.no_grad():  # transformers re-initialises the balancing biases: copy zaya's
        for (name, buf) in model.named_buffers():
            if name.endswith("balancing_biases"):
                layer = int(name.split(".")[1])
                hf.model.layers[layer].mlp.gate.balancing_biases.copy_(buf)
    return model, hf


def record_decode_routing(model) -> tuple[list, list]:
    """Hooks on every router that collect, per decode step, each layer's chosen experts (a decode step's router
    input is [rows, D]; a prefill's is [B, T, D]). Returns (the list that fills, the hook handles)."""
    seen: list[list[int]] = []

    def hook(module, args, routing):
        if args[0].dim() == 2:
            seen.append(routing.experts.reshape(-1).tolist())

    handles = [block.moe.router.register_forward_hook(hook) for block in model.blocks]
    return seen, handles


def decode_gemm_floor(model, batch: int, routing: list[list[int]]) -> float:
    """Seconds for the weight GEMMs alone of the decode steps of one ``generate`` (``routing``: what it chose,
    from ``record_decode_routing``): per step and layer the packed q/k/v projection, the output projection, the
    router's four linears and one gate-up / down pair per expert that got a row, then the head, on the shapes the
    step uses; nothing else (no attention, no norms, no glue). The least time any decoder that runs these fp32
    GEMMs can take here, with warm caches (the same few weights again and again)."""
    import torch.nn.functional as F

    from zaya.model.slots import SlotDecoder

    packed = SlotDecoder(model, 1, 1).layers
    layers = len(model.blocks)
    x = torch.randn(batch, model.config.hidden_size)
    n_experts = model.config.num_experts
    t = time.perf_counter()
    for s in range(0, len(routing), layers):
        for block, weights, chosen in zip(model.blocks, packed, routing[s:s + layers]):
            F.linear(x, weights.w)
            F.linear(x[:, :weights.o.shape[1]], weights.o)
            router = block.moe.router
            if hasattr(router, "fc1"):
                z = F.linear(x, router.down_proj.weight, router.down_proj.bias)
                z = F.linear(F.linear(z, router.fc1.weight, router.fc1.bias), router.fc2.weight, router.fc2.bias)
                F.linear(z, router.out_proj.weight)
            else:
                F.linear(x, router.proj.weight)
            experts = block.moe.experts
            for e in sorted({c for c in chosen if c < n_experts}):
                rows = x[:chosen.count(e)]
                up = F.linear(rows, experts.gate_up_proj[e])
                F.linear(up[:, :experts.down_proj.shape[-1]], experts.down_proj[e])
        F.linear(x, model.head_weight())
    return time.perf_counter() - t


def decode_cache_floor(model, batch: int, prompt: int, steps: int) -> float:
    """Seconds for the decode steps' reads of the KV cache alone: per step and layer, the two attention matmuls
    (scores against the cached keys, probabilities times the cached values) over the ``prompt + step + 1`` keys
    the step attends to, on fp32 caches laid out as the slot decoder's. At batch 8 and 512-640 keys this is memory
    traffic (~20 MiB a step on the tiny shape) that no decoder can skip, and it is left out of the GEMM floor."""
    cfg = model.config
    hq, hk, hd = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    capacity = prompt + steps + 2
    caches = [torch.randn(2, batch, hk, capacity, hd) for _ in model.blocks]
    q = torch.randn(batch, hk, hq // hk, hd)
    probs = torch.softmax(torch.randn(batch, hk, hq // hk, capacity), dim=-1)
    t = time.perf_counter()
    for step in range(steps):
        keys = prompt + step + 1
        for kv in caches:
            torch.matmul(q, kv[0, :, :, :keys].transpose(-1, -2))
            torch.matmul(probs[..., :keys], kv[1, :, :, :keys])
    return time.perf_counter() - t


def bench_generate(batch: int, prompt: int, new: int, repeats: int) -> dict:
    """``zaya.serve.generate`` against transformers' ``generate``, interleaved, best of ``repeats``; with the parts a
    decoder cannot avoid, measured in the same run: the prompt's prefill (one forward, ours and transformers') and
    the decode steps' weight GEMMs alone (``decode_gemm_floor``) and their KV-cache reads alone
    (``decode_cache_floor``). ``floor_speedup`` is transformers' time over the sum of the three: the most any
    decoder that runs these fp32 GEMMs and reads this cache could gain over transformers on this machine."""
    from zaya.serve.generate import generate

    model, hf = build_models(prompt + new + 64)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    runs = {"zaya": lambda: generate(model, ids, new, temperature=0),
            "hf": lambda: hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                      eos_token_id=None, pad_token_id=0),
            "prefill": lambda: model(ids, logits_to_keep=1),
            "hf_prefill": lambda: hf(ids, logits_to_keep=1)}
    times = {k: [] for k in runs}
    outs = {}
    with torch.no_grad():
        for name, fn in runs.items():
            outs[name] = fn()  # warm-up
        for _ in range(repeats):
            for name, fn in runs.items():  # interleaved: both see the same machine load
                t = time.perf_counter()
                outs[name] = fn()
                times[name].append(time.perf_counter() - t)
        seq = outs["zaya"]
        argmax = model(seq[:, :-1]).logits[:, prompt - 1:].argmax(-1)
        routing, handles = record_decode_routing(model)
        generate(model, ids, new, temperature=0)
        for h in handles:
            h.remove()
        floor = min(decode_gemm_floor(model, batch, routing) for _ in range(max(repeats, 2)))
        steps = len(routing) // len(model.blocks)
        cache_floor = min(decode_cache_floor(model, batch, prompt, steps) for _ in range(max(repeats, 2)))
    zaya_s, hf_s = min(times["zaya"]), min(times["hf"])
    prefill_s = min(times["prefill"])
    return {"batch": batch, "prompt": prompt, "new_tokens": new, "zaya_s": zaya_s, "hf_s": hf_s,
            "zaya_tok_s": batch * new / zaya_s, "hf_tok_s": batch * new / hf_s, "speedup": hf_s / zaya_s,
            "prefill_s": prefill_s, "hf_prefill_s": min(times["hf_prefill"]), "decode_gemm_floor_s": floor,
            "decode_cache_floor_s": cache_floor, "decode_steps": steps,
            "floor_speedup": hf_s / (prefill_s + floor + cache_floor),
            "zaya_equals_forward_argmax": bool(torch.equal(seq[:, prompt:], argmax)),
            "zaya_equals_hf": bool(torch.equal(seq, outs["hf"])), "repeats": repeats}


def bench_speculative(passage: int, new: int, repeats: int, ngram: int = 3, tokens: int = 4) -> dict:
    """Greedy tokens/s of one request on the engine with and without prompt-lookup speculation (``ngram``,
    ``tokens``), interleaved, best of ``repeats``: the prompt is a random passage of ``passage`` tokens quoted twice,
    so that its continuation repeats it; the two outputs must be the same."""
    from zaya.serve.engine import Engine
    from zaya.serve.request import Request
    from zaya.serve.sampling import SamplingParams

    model, _ = build_models(2 * passage + new + 8)
    quote = torch.randint(3, model.config.vocab_size, (passage,), generator=torch.Generator().manual_seed(1)).tolist()
    engines = {"plain": Engine(model, num_slots=1), "speculative": Engine(model, num_slots=1,
                                                                         speculative_ngram=ngram,
                                                                         speculative_tokens=tokens)}
    times = {k: [] for k in engines}
    outs = {}
    for _ in range(repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            t = time.perf_counter()
            outs[name] = engine.run([Request(prompt=quote * 2, max_tokens=new, sampling=SamplingParams(temperature=0))])[0]
            times[name].append(time.perf_counter() - t)
    if outs["plain"].output != outs["speculative"].output:
        raise SystemExit("speculation changed the greedy output")
    spec = engines["speculative"]
    plain_s, spec_s = min(times["plain"][1:]), min(times["speculative"][1:])
    return {"mode": "speculative", "prompt": 2 * passage, "new_tokens": new, "ngram": ngram, "draft_tokens": tokens,
            "plain_tok_s": new / plain_s, "speculative_tok_s": new / spec_s, "speedup": plain_s / spec_s,
            "drafts_kept": spec.accepted / max(1, spec.drafted), "same_output": True, "repeats": repeats}


def bench_prefix_cache(prefix: int, suffix: int, repeats: int) -> dict:
    """Time to first token of a request whose first ``prefix`` tokens an earlier request already computed, on an
    engine with prefix caching against one without, interleaved, median of ``repeats`` (a fresh suffix each time);
    the first tokens and their log-probabilities must agree."""
    from zaya.serve.engine import Engine
    from zaya.serve.request import Request
    from zaya.serve.sampling import SamplingParams

    model, _ = build_models(prefix + suffix + 64)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, model.config.vocab_size, (prefix,), generator=g).tolist()
    engines = {"cached": Engine(model, num_slots=1), "cold": Engine(model, num_slots=1, prefix_caching=False)}
    engines["cached"].run([Request(prompt=shared + [5] * suffix, max_tokens=1)])  # computes and caches the prefix
    times = {k: [] for k in engines}
    for i in range(repeats + 1):  # the first round warms up
        prompt = shared + torch.randint(3, model.config.vocab_size, (suffix,), generator=g).tolist()
        outs = {}
        for name, engine in engines.items():
            t = time.perf_counter()
            outs[name] = engine.run([Request(prompt=prompt, max_tokens=1, logprobs=0,
                                             sampling=SamplingParams(temperature=0))])[0]
            times[name].append(time.perf_counter() - t)
        a, b = outs["cached"].output_logprobs[0], outs["cold"].output_logprobs[0]
        if a.token != b.token or abs(a.logprob - b.logprob) > 1e-4:
            raise SystemExit(f"the cached prefix changed the first token: {a} vs {b}")
    cached_s, cold_s = statistics.median(times["cached"][1:]), statistics.median(times["cold"][1:])
    e = engines["cached"]
    return {"mode": "prefix_cache", "prefix": prefix, "suffix": suffix, "ttft_cold_ms": 1e3 * cold_s,
            "ttft_cached_ms": 1e3 * cached_s, "speedup": cold_s / cached_s,
            "hit_rate": e.prefix_hits / e.prefix_queried, "same_first_token": True, "repeats": repeats}


def bench_memory(context: int, slots: int, in_flight: int) -> dict:
    """Resident memory (RSS) of the process: before the model, with the model, with an idle engine of ``slots``
    sequences of ``context`` tokens, and while ``slots`` requests hold ``in_flight`` tokens each; beside the
    weights' bytes and what reserving every slot's whole context would take (the engine before paged memory)."""
    import psutil

    from zaya.model.slots import SlotDecoder
    from zaya.serve.engine import Engine
    from zaya.serve.request import Request

    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    base = rss()
    model, hf = build_models(context)
    del hf
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with_model = rss()
    engine = Engine(model, num_slots=slots, capacity=context)
    idle = rss()
    g = torch.Generator().manual_seed(4)
    # distinct prompts (nothing shared through the prefix cache), and enough max_tokens that no request finishes
    # before the last one is prefilled
    requests = [Request(prompt=torch.randint(3, model.config.vocab_size, (in_flight - 1,), generator=g).tolist(),
                        max_tokens=slots * in_flight // 512 + 8) for _ in range(slots)]
    for r in requests:
        engine.submit(r)
    while not all(len(r.output) >= 1 for r in requests):  # every request has its whole prompt in the cache
        engine.step()
    busy = rss()
    held = engine.decoder.pool.held()
    while engine.busy:
        engine.step()
    if any(r.finish_reason != "length" for r in requests):
        raise SystemExit(f"a request failed: {[r.error for r in requests if r.error]}")
    full = SlotDecoder.bytes_needed(model, slots, context, prefix_states=True)
    return {"mode": "memory", "context": context, "slots": slots, "weights_mb": weights / 2**20,
            "process_before_model_mb": base / 2**20, "model_growth_mb": (with_model - base) / 2**20,
            "idle_engine_growth_mb": (idle - with_model) / 2**20,
            "busy_growth_mb": (busy - with_model) / 2**20, "tokens_in_flight": slots * in_flight,
            "blocks_held": held, "pool_block_bytes": SlotDecoder.block_bytes(model, prefix_states=True),
            "whole_context_reservation_mb": full / 2**20}


def bench_compiled_decode(prompt: int, steps: int, repeats: int) -> dict:
    """The slot decoder's step at batch 1 (tiny shape, fp32) eager against compiled (``SlotDecoder(compile=True)``,
    inductor), on two decoders holding the same prompt, alternating rounds of ``steps`` steps, median per step;
    compile time (the first compiled steps) reported apart; the logits must agree."""
    from zaya.model.slots import SlotDecoder

    model, _ = build_models(prompt + steps * (repeats + 2) + 8)
    ids = torch.randint(3, model.config.vocab_size, (prompt + steps * (repeats + 2),),
                        generator=torch.Generator().manual_seed(5))
    decoders = {"eager": SlotDecoder(model, 1, len(ids) + 1), "compiled": SlotDecoder(model, 1, len(ids) + 1,
                                                                                      compile=True)}
    times: dict = {k: [] for k in decoders}
    with torch.no_grad():
        for dec in decoders.values():
            dec.prefill(0, ids[:prompt], 0)
            dec.ensure(0, len(ids))
        t = time.perf_counter()
        for p in (prompt, prompt + 1):  # the first compile, and the step that would recompile for a new span
            decoders["compiled"].step(ids[p:p + 1], torch.tensor([p]), p + 1)
        compile_s = time.perf_counter() - t
        decoders["eager"].step(ids[prompt:prompt + 1], torch.tensor([prompt]), prompt + 1)
        decoders["eager"].step(ids[prompt + 1:prompt + 2], torch.tensor([prompt + 1]), prompt + 2)
        worst = 0.0
        for r in range(repeats):
            start = prompt + 2 + r * steps
            logits = {}
            for name, dec in decoders.items():
                for p in range(start, start + steps):
                    t = time.perf_counter()
                    logits[name] = dec.step(ids[p:p + 1], torch.tensor([p]), p + 1)
                    times[name].append(time.perf_counter() - t)
            worst = max(worst, float((logits["eager"] - logits["compiled"]).abs().max()))
    eager_ms, compiled_ms = (1e3 * statistics.median(times[k]) for k in ("eager", "compiled"))
    return {"mode": "compiled_decode", "prompt": prompt, "steps": steps * repeats, "eager_step_ms": eager_ms,
            "compiled_step_ms": compiled_ms, "speedup": eager_ms / compiled_ms, "compile_s": compile_s,
            "max_logit_difference": worst, "compiled_in_use": decoders["compiled"]._compiled is not None}


async def _client(url: str, jobs: asyncio.Queue, prompt: list[int], max_tokens: int, stats: list) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        while True:
            try:
                jobs.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {"prompt": [prompt], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            start = time.perf_counter()
            stamps = []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        stamps.append(time.perf_counter())
            stats.append((start, stamps))


def load_test(concurrency: list[int], requests_per_client: int, prompt_len: int, max_tokens: int) -> list[dict]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_helpers import ServerThread

    from zaya.serve.engine import Engine
    from zaya.serve.server import build_app

    model, _ = build_models(prompt_len + max_tokens + 64)

    class Tok:  # token ids in and out: the load test measures the engine and the API, not a tokenizer
        def encode(self, text):
            return [ord(c) % model.config.vocab_size for c in text]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(65 + i % 26) for i in ids)

        source = ""
        prefix_ids: list[int] = []

    tok = Tok()
    engine = Engine(model, num_slots=max(concurrency), capacity=prompt_len + max_tokens + 8, decode=tok.decode)
    prompt = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(2))
    rows = []
    with ServerThread(build_app(engine, tok, model_name="tiny")) as url:
        for c in [1] + concurrency:  # the first pass warms up
            jobs: asyncio.Queue = asyncio.Queue()
            for _ in range(c * requests_per_client):
                jobs.put_nowait(1)
            stats: list = []

            async def main():
                await asyncio.gather(*[_client(url, jobs, prompt.tolist(), max_tokens, stats) for _ in range(c)])

            t0 = time.perf_counter()
            asyncio.run(main())
            wall = time.perf_counter() - t0
            ttft = sorted(s[1][0] - s[0] for s in stats)
            gaps = sorted(b - a for _, st in stats for a, b in zip(st, st[1:]))
            tokens = sum(len(st) for _, st in stats)
            rows.append({"streams": c, "requests": len(stats), "wall_s": wall, "requests_per_s": len(stats) / wall,
                         "tokens_per_s": tokens / wall, "ttft_p50_ms": 1e3 * _pct(ttft, 50),
                         "ttft_p99_ms": 1e3 * _pct(ttft, 99), "token_p50_ms": 1e3 * _pct(gaps, 50),
                         "token_p99_ms": 1e3 * _pct(gaps, 99)})
    return rows[1:]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def state_bytes(config_path: str, context: int = 4096, dtype_bytes: int = 2) -> dict:
    """KV + CCA state per token (bf16) against MHA of the same width (K and V of hidden_size channels a layer)."""
    from zaya.config import load_config

    cfg = load_config(config_path).model
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    reach = cfg.cca_depthwise_kernel - 1 + cfg.cca_grouped_kernel - 1
    channels = (cfg.num_query_heads + cfg.num_kv_heads) * cfg.head_dim
    fixed = cfg.num_layers * (channels * reach + cfg.num_kv_heads * cfg.head_dim // 2) * dtype_bytes
    mha = cfg.num_layers * 2 * cfg.hidden_size * dtype_bytes
    return {"config": config_path, "kv_bytes_per_token": kv, "fixed_state_bytes_per_sequence": fixed,
            f"kv_plus_state_per_token_at_{context}": kv + fixed / context, "mha_same_width_bytes_per_token": mha,
            "ratio_kv": mha / kv, f"ratio_with_state_at_{context}": mha / (kv + fixed / context)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--quick", action="store_true", help="short runs (a smoke test of the script)")
    ap.add_argument("--speculative", action="store_true", help="only the prompt-lookup speculation benchmark")
    ap.add_argument("--prefix-cache", action="store_true", help="only the prefix-cache time-to-first-token benchmark")
    ap.add_argument("--memory", action="store_true", help="only the resident-memory benchmark (131,072 positions)")
    ap.add_argument("--compile", action="store_true", help="only the compiled against eager decode step benchmark")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.prefix_cache:
        prefix, suffix = (64, 4) if args.quick else (1024, 16)
        print(json.dumps(bench_prefix_cache(prefix, suffix, 1 if args.quick else max(5, args.repeats))), flush=True)
        return
    if args.compile:
        print(json.dumps(bench_compiled_decode(64, 16 if args.quick else 64, 1 if args.quick else args.repeats)),
              flush=True)
        return
    if args.memory:
        context, in_flight = (4096, 64) if args.quick else (131072, 1024)
        print(json.dumps(bench_memory(context, 16, in_flight)), flush=True)
        return
    if args.speculative:
        passage, new = (16, 16) if args.quick else (128, 256)
        print(json.dumps(bench_speculative(passage, new, 1 if args.quick else args.repeats)), flush=True)
        return
    print(json.dumps(state_bytes("configs/zaya1-base.toml")))
    print(json.dumps(state_bytes("configs/tiny.toml", context=256)))
    if not args.skip_generate:
        for batch in (1, 8):
            prompt, new = (32, 8) if args.quick else (512, 128)
            print(json.dumps(bench_generate(batch, prompt, new, 1 if args.quick else args.repeats)), flush=True)
    if not args.skip_load:
        per_client, (p, m) = (1, (16, 4)) if args.quick else (4, (64, 32))
        for row in load_test([1, 4, 16], per_client, p, m):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
