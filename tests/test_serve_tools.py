"""Tools in ``zaya serve``: the default template's tool convention (rendered as transformers renders the exported
template), ``tool_choice`` required / named always giving a call that parses and validates against the function's
parameters (non-streamed, and streamed as deltas the openai client assembles), ``auto`` returning what the model
wrote as content when it is no call, finding calls in a reply, and the requests refused with OpenAI's codes."""

from __future__ import annotations

import json

import pytest

from serve_helpers import openai_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

ASK = [{"role": "user", "content": "Weather?"}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time."}}]
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "additionalProperties": False}}
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.fixture(scope="module")
def client(shakespeare_dataset):
    with openai_server(shakespeare_dataset / "tokenizer.json", capacity=1024) as (_, _, client):
        yield client


def _check_calls(calls, names) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice, names", [("required", {"get_weather", "now"}),
                                           ({"type": "function", "function": {"name": "get_weather"}},
                                            {"get_weather"})], ids=["required", "named"])
def test_a_forced_call_always_parses_and_validates(client, choice, names):
    seen = set()
    for seed in range(4):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                             seed=seed, max_tokens=200)
        choice_ = out.choices[0]
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        _check_calls(choice_.message.tool_calls, names)
        seen.update(c.function.name for c in choice_.message.tool_calls)
    assert seen <= names


def test_a_streamed_forced_call_is_assembled_by_the_client(client):
    with client.chat.completions.stream(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice="required",
                                        seed=5, max_tokens=200) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "now"})
    raw = list(client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice="required",
                                              seed=5, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in raw if c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].tool_calls[0].index == 0
    assert deltas[0].tool_calls[0].function.arguments == choice.message.tool_calls[0].function.arguments


def test_auto_returns_what_is_no_call_as_content(client):
    out = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice="auto",
                                         temperature=0, max_tokens=12)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice="auto",
                                           temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == choice.message.content


def test_auto_with_a_response_format_is_a_call_or_that_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    kinds = set()
    for seed in range(6):
        choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, response_format=fmt,
                                                seed=seed, max_tokens=200).choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message.tool_calls, {"get_weather", "now"})
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(choice.message.content), WEATHER)
            kinds.add("json")
    assert kinds  # which of the two a random model writes is its choice


def test_refused_tool_requests(client):
    cases = [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
             ({"tools": TOOLS + TOOLS[:1]}, "tools"),
             ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
             ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(65)]}, "tools"),
             ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
               "tool_choice": "required"}, "tools"),
             ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
             ({"messages": [{"role": "user", "content": None}]}, "messages.0")]
    for extra, param in cases:
        body = {"model": "tiny", "messages": ASK, "tools": TOOLS, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**body)
        assert caught.value.param == param, (extra, caught.value.body)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    assert caught.value.param == "tool_choice"


def test_the_default_template_renders_tools_as_transformers_does(tmp_path, shakespeare_dataset):
    """The exported template (zaya's default) rendered by transformers' ``apply_chat_template(tools=...)`` and by
    zaya's server give the same text; it shows the tools, the earlier call and the tool's result."""
    import shutil

    from transformers import AutoTokenizer

    from zaya.data.chat_template import DEFAULT_TEMPLATE
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.api import ChatRequest
    from zaya.serve.chat import ChatTemplate

    shutil.copy(shakespeare_dataset / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "bos_token": "<|bos|>",
                                                                "chat_template": DEFAULT_TEMPLATE}))
    body = ChatRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    hf = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        body.template_messages(), tools=body.template_tools(), tokenize=False, add_generation_prompt=True)
    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")
    ids, stops = ChatTemplate(tok).render(body.template_messages(), tools=body.template_tools())
    assert tok.decode(ids) == hf
    assert hf.startswith('Tools: to call a function, write <tool_call>{"name": NAME, "arguments": ARGUMENTS}'
                         '</tool_call>. The functions:\n{"type": "function", "function": {"name": "get_weather"')
    assert hf.endswith('Assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
                       '</tool_call>\n\nTool: sunny\n\nAssistant:')
    assert stops == ("\n\nUser:", "\n\nTool:")


def test_finding_calls_in_a_reply():
    from zaya.serve.tools import ReplyStream, parse_calls, reply

    names = {"f", "g"}
    content, calls = parse_calls('Sure. <tool_call>\n{"name": "f", "arguments": {"a": [1]}}\n</tool_call>\n'
                                 '<tool_call>{"name": "g", "arguments": {}}</tool_call> ', names)
    assert content == "Sure. " and [(c.name, c.arguments) for c in calls] == [("f", '{"a": [1]}'), ("g", "{}")]
    for text in ['<tool_call>{"name": "f", "arguments": {}}', '<tool_call>{"name": "h", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": 3}</tool_call>', '<tool_call>{"name": "f"</tool_call>',
                 '<tool_call>{"name": "f", "arguments": {}}</tool_call> and more', "no call",
                 '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}</tool_call>"]:
        assert parse_calls(text, names) is None, text
        assert reply(text, "length", names) == ({"role": "assistant", "content": text}, "length")
    stream = ReplyStream(names)
    assert stream.delta("Hi <tool_c", False, None) == ({"content": "Hi "}, None)  # a possible tag is held back
    assert stream.delta("Hi <tool_call>{", False, None) == ({"content": ""}, None)
    delta, finish = stream.delta('Hi <tool_call>{"name": "g", "arguments": {}}</tool_call>', True, "stop")
    assert finish == "tool_calls" and delta["content"] == ""
    assert delta["tool_calls"][0]["function"] == {"name": "g", "arguments": "{}"}
    stream = ReplyStream(names)
    stream.delta("x <tool_call>{", False, None)
    assert stream.delta("x <tool_call>{oops", True, "length") == ({"content": "<tool_call>{oops"}, "length")
