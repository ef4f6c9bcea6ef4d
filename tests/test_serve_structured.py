"""Structured output in ``zaya serve``: ``response_format`` json_schema / json_object through the ``openai`` client
(every reply parses and validates), the constraint's mask (ids past the tokenizer, eos only where the grammar may
end), the compile cache, refused schemas as 400s naming the field, and ``benchmarks/serve_structured.py`` on a few
random schemas. One module-scoped server: the tiny model on the 512-entry tokenizer, with a 576-row vocabulary (64
ids the tokenizer does not have)."""

from __future__ import annotations

import json
import random
import runpy
from pathlib import Path

import pytest
import torch

from bench_helpers import run_benchmark
from serve_helpers import openai_server


openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent
ASK = [{"role": "user", "content": "Describe a person."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "home"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "ç"]}, "maxItems": 3},
                         "home": {"type": "object", "required": ["x"], "additionalProperties": False,
                                  "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                                 "y": {"type": ["null", "boolean"]}}}}}


@pytest.fixture(scope="module")
def served(shakespeare_dataset):
    with openai_server(shakespeare_dataset / "tokenizer.json", vocab_size=576, capacity=512) as served:
        yield served


def _schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_replies_parse_and_validate(served):
    _, _, client = served
    for seed in range(4):  # sampled at temperature 1: different replies, each valid
        out = client.chat.completions.create(model="tiny", messages=ASK, seed=seed, max_tokens=300,
                                             response_format=_schema_format(PERSON))
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    greedy = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=300,
                                            response_format=_schema_format(PERSON)).choices[0].message.content
    jsonschema.validate(json.loads(greedy), PERSON)


def test_json_object_and_streamed_json_schema(served):
    _, _, client = served
    out = client.chat.completions.create(model="tiny", messages=ASK, seed=1, max_tokens=300,
                                         response_format={"type": "json_object"}).choices[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.message.content), dict)
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, seed=2, max_tokens=300, stream=True,
                                                 response_format=_schema_format(PERSON)))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"


def _nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_refused_schemas_are_400s_naming_the_field(served):
    _, _, client = served
    cases = [(_schema_format({"type": "strin"}), "response_format.json_schema.schema", "strin"),
             (_schema_format({"enum": ["x" * 70_000]}), "response_format.json_schema.schema", "at most 65,536"),
             (_schema_format(_nested(200)), "response_format.json_schema.schema", "recursion limit"),
             ({"type": "json_schema"}, "response_format", "json_schema is required"),
             ({"type": "xml"}, "response_format.type", "")]
    for fmt, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt)
        assert caught.value.param == param and words in caught.value.message, caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                       extra_body={"ignore_eos": True})
    assert caught.value.param == "ignore_eos"
    text = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0,
                                          response_format={"type": "text"}).choices[0]
    assert text.message.content is not None  # "text" is no constraint


def test_the_mask_forbids_ids_past_the_tokenizer_and_eos_until_the_grammar_may_end(served):
    from zaya.serve.structured import Grammars, json_schema_grammar

    tok, _, _ = served
    grammars = Grammars(tok, eos_token_id=2)
    grammar = json_schema_grammar({"enum": ["ab", "abc"]})
    constraint = grammars.constraint(grammar)
    assert grammars.constraint(grammar).matcher is not constraint.matcher  # each request its own copy ...
    assert list(grammars._compiled) == [grammar]  # ... of one compiled grammar
    logits = torch.zeros(1, 576)
    ids = tok.encode('"abc"')
    for i, token in enumerate(ids):
        allowed = constraint.mask(logits)[0] > float("-inf")
        assert allowed[token] and not allowed[512:].any() and not allowed[2]
        assert torch.equal(logits, torch.zeros(1, 576))  # the engine's logits are left as they were
        constraint.accept(token)
    allowed = constraint.mask(logits)[0] > float("-inf")
    assert allowed.nonzero().flatten().tolist() == [2]  # complete: only eos
    constraint.accept(2)
    with pytest.raises(RuntimeError, match="refused token"):
        grammars.constraint(grammar).accept(tok.encode("x")[0])


def test_the_compile_cache_is_bounded():
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.structured import Grammars, json_schema_grammar

    tok = Tokenizer.train(["a b c"] * 4, 320)
    grammars = Grammars(tok, eos_token_id=2, cache_size=2)
    for n in (1, 2, 3, 1):
        grammars.constraint(json_schema_grammar({"type": "string", "maxLength": n}))
    assert list(grammars._compiled) == [json_schema_grammar({"type": "string", "maxLength": n}) for n in (3, 1)]


def test_random_schemas_benchmark(monkeypatch, capsys, shakespeare_dataset):
    """``benchmarks/serve_structured.py`` on 5 random schemas (the recorded run has 100): every reply valid."""
    result = run_benchmark(monkeypatch, capsys, "serve_structured.py", "--schemas", "5", "--overhead-schemas", "2",
                           "--tokenizer", str(shakespeare_dataset / "tokenizer.json"), "--capacity", "768",
                           "--concurrency", "4")[-1]
    assert result["valid"] == result["stop"] == 5 and result["failures"] == [], result
    assert result["tokens"] > 0 and result["mask_us_per_token"] > 0


def test_random_schemas_are_drawn_from_the_seed():
    module = runpy.run_path(str(ROOT / "benchmarks/serve_structured.py"))
    draw = [module["random_schema"](random.Random(3)) for _ in range(2)]
    assert draw[0] == draw[1] and draw[0]["type"] == "object"
    jsonschema.Draft202012Validator.check_schema(draw[0])
