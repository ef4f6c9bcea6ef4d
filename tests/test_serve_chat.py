"""Chat templates from a checkpoint's tokenizer_config.json: rendered as Hugging Face does (the features real
templates use), in Jinja's immutable sandbox and a child process, so that a template never runs code, never hangs
the server and never fails more than its own request; a template that does not parse stops the server at start."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from serve_helpers import ServerThread, post_json, served_model

MISTRAL_LIKE = (
    "{{ bos_token }}{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}{%- continue -%}{%- endif -%}"
    "{%- if (m['role'] == 'user') != ((loop.index0 - (1 if ns.system else 0)) % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if m['role'] == 'user' -%}[INST] {{ (ns.system + ' ') if ns.system and loop.index0 == 1 else '' }}"
    "{{ m['content'] }} [/INST]{%- else -%}{{ m['content'] }}{{ eos_token }}{%- endif -%}"
    "{%- if loop.index0 > 50 -%}{%- break -%}{%- endif -%}"
    "{%- endfor -%}{{ '' if add_generation_prompt else eos_token }}<meta>{{ messages[-1] | tojson }}</meta>")


def _tokenizer_dir(tmp_path, shakespeare_dataset, template=None, config=None):
    from zaya.data.tokenizer import Tokenizer

    d = tmp_path / "tok"
    d.mkdir(exist_ok=True)
    shutil.copy(shakespeare_dataset / "tokenizer.json", d / "tokenizer.json")
    if config is None:
        config = {"chat_template": template, "unk_token": "<unk>"}
    (d / "tokenizer_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return Tokenizer.from_file(d / "tokenizer.json")


def test_a_real_chat_template_renders_with_hugging_face_features(tmp_path, shakespeare_dataset):
    """namespace, loop controls, tojson (non-ASCII kept), raise_exception and the special tokens as ids."""
    from zaya.serve.chat import ChatTemplate, ChatTemplateError

    tok = _tokenizer_dir(tmp_path, shakespeare_dataset, MISTRAL_LIKE)
    template = ChatTemplate.for_tokenizer(tok)
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hail, Cäsar"},
                    {"role": "assistant", "content": "Hail."}, {"role": "user", "content": "Again?"}]
        ids, stops = template.render(messages)
        text = ('<|bos|>[INST] Be brief. Hail, Cäsar [/INST]Hail.<|eos|>[INST] Again? [/INST]'
                '<meta>{"role": "user", "content": "Again?"}</meta>')
        assert stops == () and ids[0] == tok.special.bos and ids.count(tok.special.eos) == 1
        assert tok.decode(ids) == text
        with pytest.raises(ChatTemplateError, match="roles must alternate") as caught:
            template.render([{"role": "assistant", "content": "x"}])
        assert caught.value.client_error
    finally:
        template.close()


# Each would write the marker file (or run a command) if the template could reach Python.
ESCAPES = [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ joiner.__init__.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in ().__class__.__base__.__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c('touch MARKER', shell=True) }}{% endif %}{% endfor %}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ messages.append('x') }}{{ messages[0].update({'role': 'x'}) }}",
    "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}{{ strftime_now.__globals__ }}",
    "{% set x = messages.pop() %}{{ x }}",
    "{{ messages|map(attribute='__class__')|list }}",  # Jinja's sandbox printed these as empty, unrefused
    "{{ messages|selectattr('__class__')|list }}",
    "{% set ns = namespace(a=1) %}{% set ns.__class__ = 1 %}{{ ns }}",
]


@pytest.mark.parametrize("payload", ESCAPES)
def test_a_template_never_reaches_python(tmp_path, shakespeare_dataset, payload, monkeypatch):
    from zaya.serve.chat import ChatTemplate, ChatTemplateError

    monkeypatch.chdir(tmp_path)
    template = ChatTemplate.for_tokenizer(_tokenizer_dir(tmp_path, shakespeare_dataset, payload))
    try:
        with pytest.raises(ChatTemplateError, match="unsafe") as caught:
            template.render([{"role": "user", "content": "hi"}])
        assert not caught.value.client_error and "tokenizer_config.json" in str(caught.value)
    finally:
        template.close()
    assert not (tmp_path / "MARKER").exists()


def test_a_template_that_cannot_be_used_stops_the_server_at_start(tmp_path, shakespeare_dataset):
    from zaya.core.errors import ConfigError
    from zaya.serve.chat import ChatTemplate

    deep = '{"chat_template": ' + "[" * 100000 + "]" * 100000 + "}"  # nested past the recursion limit
    for config, words in (({"chat_template": "{% for m in messages %}{{ m }"}, "does not parse on line 1"),
                          ({"chat_template": "x\n{{ messages|no_such_filter }}"}, "does not parse on line 2"),
                          ({"chat_template": "{% if x %}" * 5000}, "nests too deeply"),
                          ('{"chat_template": "x"', "cannot be read as JSON"),
                          (deep, "cannot be read as JSON .JSON nested too deeply"),
                          ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "none 'default'"),
                          ({"chat_template": 3}, "not a template string")):
        with pytest.raises(ConfigError, match=words) as caught:  # a config that is no JSON: loading the tokenizer
            ChatTemplate.for_tokenizer(_tokenizer_dir(tmp_path, shakespeare_dataset, config=config))
        assert "tokenizer_config.json" in str(caught.value)


def _never_compile_here(monkeypatch):
    """Jinja compiling in this (the server's) process fails the test, before it could fold a 10 GB constant."""
    import jinja2

    def refuse(*args, **kwargs):
        raise AssertionError("a chat template was compiled in the server's process")

    monkeypatch.setattr(jinja2.Environment, "compile", refuse)


def test_compiling_a_template_evaluates_none_of_it():
    """Jinja folds constant expressions while compiling (the optimizer, and {{ }} of literals): the compiled code of
    these templates held their 10 MB results (at 10**10, compiling took 10 GB in the server process)."""
    from zaya.data.template_sandbox import environment

    for source in ("{{ 'x' * 10000000 }}", "{{ 'x'|center(10000000) }}", "{% if 'ab' * 10000000 %}y{% endif %}",
                   "{% set s = 'x' * 10000000 %}{{ s }}", "{{ ('x' * 10000000)|length }}"):
        assert len(environment().compile(source, raw=True)) < 20000, source


def test_a_template_is_compiled_only_in_its_child(tmp_path, shakespeare_dataset, monkeypatch):
    """The server's process never compiles a template (T13: {{ 'x' * 10000000000 }} OOM-killed zaya serve at
    start); the child's bounds make such a template fail its request, and the next one renders."""
    from zaya.serve.chat import ChatTemplate, ChatTemplateError

    _never_compile_here(monkeypatch)
    for source, kind in (("{{ 'x' * 10000000000 }}", "memory"), ("{{ 'x'|center(500000000) }}", "too_large"),
                         ("{{ 'x'|center(10000000000) }}", "memory")):
        tok = _tokenizer_dir(tmp_path, shakespeare_dataset, "{% if messages[0]['content'] == 'go' %}" + source
                             + "{% else %}ok{% endif %}")
        start = time.time()
        template = ChatTemplate.for_tokenizer(tok, timeout=2.0, max_chars=1 << 20, max_memory=512 << 20)
        try:
            with pytest.raises(ChatTemplateError, match=kind):
                template.render([{"role": "user", "content": "go"}])
            assert template.render([{"role": "user", "content": "fine"}])[0] == tok.encode("ok")
        finally:
            template.close()
        assert time.time() - start < 10


def test_a_pathological_template_is_bounded(tmp_path, shakespeare_dataset):
    """A loop of 10**10 empty iterations ends at the timeout, a string doubled forty times at the memory or size
    limit; each fails its own render, and the next render works (the child is replaced when it was killed)."""
    from zaya.serve.chat import ChatTemplate, ChatTemplateError

    cases = {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}": "timeout",
             "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
             "{{ ns.s }}": "(memory|too_large|timeout)",
             "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}": "too_large",
             "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}": "failed",
             "{{ '\\ud800' }}": "not valid Unicode"}
    for source, kind in cases.items():
        tok = _tokenizer_dir(tmp_path, shakespeare_dataset, "{% if messages[0]['content'] == 'go' %}" + source
                             + "{% else %}ok{% endif %}")
        template = ChatTemplate.for_tokenizer(tok, timeout=0.5, max_chars=1 << 20, max_memory=512 << 20)
        try:
            start = time.time()
            with pytest.raises(ChatTemplateError, match=kind):
                template.render([{"role": "user", "content": "go"}])
            assert time.time() - start < 5
            assert template.render([{"role": "user", "content": "fine"}])[0] == tok.encode("ok")
        finally:
            template.close()


def test_the_server_with_a_hostile_template(tmp_path, shakespeare_dataset, monkeypatch):
    """Over HTTP: a template reaching for os is a 500 naming it (no file written), one refusing the messages a 400
    with its message, one that hangs a 500 after the timeout while /health and completions go on."""
    from zaya.serve.engine import Engine
    from zaya.serve.limits import ServeLimits
    from zaya.serve.server import build_app

    monkeypatch.chdir(tmp_path)
    _never_compile_here(monkeypatch)
    template = ("{% if messages[0]['content'] == 'escape' %}{{ cycler.__init__.__globals__.os.system('touch MARKER') }}"
                "{% elif messages[0]['content'] == 'huge' %}{{ 'x' * 10000000000 }}"
                "{% elif messages[0]['content'] == 'hang' %}{% for i in range(100000) %}{% for j in range(100000) %}"
                "{% endfor %}{% endfor %}{% elif messages|length > 1 %}{{ raise_exception('one message only') }}"
                "{% else %}{{ bos_token }}U: {{ messages[0]['content'] }}\nA:{% endif %}")
    tok = _tokenizer_dir(tmp_path, shakespeare_dataset, template)
    engine = Engine(served_model(vocab_size=512, max_seq_len=64), num_slots=2, capacity=64,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    with ServerThread(build_app(engine, tok, "tiny", limits=ServeLimits(template_timeout=1.0))) as url:
        chat = f"{url}/v1/chat/completions"
        r = post_json(chat, {"messages": [{"role": "user", "content": "escape"}]})
        assert r.status_code == 500 and "tokenizer_config.json" in r.json()["error"]["message"]
        assert not (tmp_path / "MARKER").exists()
        r = post_json(chat, {"messages": [{"role": "user", "content": "huge"}]})
        assert r.status_code == 500 and "(memory)" in r.json()["error"]["message"]
        r = post_json(chat, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
        assert r.status_code == 400 and "one message only" in r.json()["error"]["message"]
        hung = {}
        import threading

        worker = threading.Thread(target=lambda: hung.setdefault("r", post_json(
            chat, {"messages": [{"role": "user", "content": "hang"}]})))
        start = time.time()
        worker.start()
        time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200
        assert post_json(f"{url}/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200
        worker.join(10)
        assert hung["r"].status_code == 500 and "timeout" in hung["r"].json()["error"]["message"]
        assert time.time() - start < 6
        r = post_json(chat, {"messages": [{"role": "user", "content": "Speak"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode("U: Speak\nA:")) + 1
