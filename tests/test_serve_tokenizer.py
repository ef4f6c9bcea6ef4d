"""A hostile or mismatched tokenizer.json beside a model: a tokenizer that panics on a text (a Split regex that makes
Oniguruma give up, a Rust panic that is a BaseException) is an error naming the file, exit 2 for the CLI and a 400
for that one request in the server; a tokenizer with ids past the model's vocabulary, or without its eos, is refused
at load, a much smaller one warned about, and ids it does not have decode visibly instead of vanishing."""

from __future__ import annotations

import json

import pytest

from serve_helpers import ServerThread, post_json, served_checkpoint, served_model

PANIC_TEXT = "a" * 40 + "!"


def _write_tokenizer(shakespeare_dataset, path, change=None):
    spec = json.loads((shakespeare_dataset / "tokenizer.json").read_text())
    if change is not None:
        change(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return path


def _panicking(spec):  # the audit's payload: a catastrophic-backtracking split before the byte-level one
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "^(a+)+$"}, "behavior": "Isolated", "invert": False},
        spec["pre_tokenizer"]]}


def _twenty_entries(spec):
    spec["model"]["vocab"] = {k: v for k, v in spec["model"]["vocab"].items() if v < 20}
    spec["model"]["merges"] = []
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < 20]


@pytest.fixture(scope="module")
def panicking(shakespeare_dataset, tmp_path_factory):
    from zaya.data.tokenizer import Tokenizer

    path = _write_tokenizer(shakespeare_dataset, tmp_path_factory.mktemp("panic") / "tokenizer.json", _panicking)
    # a chat template that passes the message through (zaya's simple one puts "User: " before it)
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    return Tokenizer.from_file(path)


def test_a_tokenizer_that_panics_is_an_error_naming_its_file(panicking):
    from zaya.data.tokenizer import TokenizerFailure

    for encode in (panicking.encode, panicking.encode_fast, lambda t: panicking.encode_batch([t]),
                   lambda t: panicking.encode_fast(t, special_tokens=True)):
        with pytest.raises(TokenizerFailure, match="failed on th(is text|ese texts)") as caught:
            encode(PANIC_TEXT)
        message = str(caught.value)
        assert panicking.source in message and "PanicException" in message and "fix or replace" in message
        assert caught.value.exit_code == 2
    assert panicking.decode(panicking.encode("ROMEO: a!")) == "ROMEO: a!"  # other texts still work


def test_any_library_failure_is_translated_but_not_an_interrupt(panicking, monkeypatch):
    from zaya.data.tokenizer import TokenizerFailure

    class Panic(BaseException):  # what pyo3 raises for a Rust panic: not an Exception
        pass

    class Backend:
        def __init__(self, exc):
            self.exc = exc

        def decode(self, ids, skip_special_tokens=False):
            raise self.exc

    monkeypatch.setattr(panicking, "backend", Backend(Panic("decoder exploded")))
    with pytest.raises(TokenizerFailure, match="failed on these token ids .Panic: decoder exploded"):
        panicking.decode([5, 6])
    for passed in (KeyboardInterrupt(), SystemExit(3), MemoryError()):
        monkeypatch.setattr(panicking, "backend", Backend(passed))
        with pytest.raises(type(passed)):
            panicking.decode([5, 6])


def _checkpoint(directory, tokenizer_change, shakespeare_dataset):
    tokenizer = _write_tokenizer(shakespeare_dataset, directory.parent / "changed" / "tokenizer.json", tokenizer_change)
    return served_checkpoint(directory, tokenizer, max_seq_len=64)


def test_zaya_generate_with_a_panicking_tokenizer_exits_2(tmp_path, shakespeare_dataset, capsys):
    from zaya.cli import main

    ckpt = _checkpoint(tmp_path / "ckpt", _panicking, shakespeare_dataset)
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", PANIC_TEXT, "--max-new-tokens", "2",
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"the tokenizer {ckpt / 'tokenizer.json'} failed on this text" in err and "Traceback" not in err


def test_the_server_answers_a_text_the_tokenizer_fails_on_with_a_400(panicking):
    from zaya.serve.engine import Engine
    from zaya.serve.server import build_app

    engine = Engine(served_model(vocab_size=512, max_seq_len=64), num_slots=2, capacity=64,
                    decode=lambda ids: panicking.decode(ids, skip_special_tokens=True))
    with ServerThread(build_app(engine, panicking, "tiny")) as url:
        for route, body in (("completions", {"prompt": PANIC_TEXT, "max_tokens": 2}),
                            ("chat/completions", {"messages": [{"role": "user", "content": PANIC_TEXT}],
                                                  "max_tokens": 2})):
            r = post_json(f"{url}/v1/{route}", body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "tokenizer_failed" and "cannot encode" in error["message"]
            assert panicking.source in error["message"]
        r = post_json(f"{url}/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_a_tokenizer_is_checked_against_the_model(tmp_path, shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer, TokenizerError

    tok = Tokenizer.from_file(_write_tokenizer(shakespeare_dataset, tmp_path / "full" / "tokenizer.json"))
    assert tok.max_id == 511
    with pytest.raises(TokenizerError, match=r"ids up to 511 .* vocabulary of 448: its ids past 447") as caught:
        tok.check_model(448, 2, "M")
    assert tok.source in str(caught.value) and "the model M" in str(caught.value)
    assert tok.check_model(512, 2, "M") is None
    assert tok.check_model(576, 2, "M") is None  # a padded vocabulary (as ZAYA1's 262,272 rows) is normal
    small = Tokenizer.from_file(_write_tokenizer(shakespeare_dataset, tmp_path / "small" / "tokenizer.json",
                                                 _twenty_entries))
    with pytest.raises(TokenizerError, match="token id 30, which the tokenizer"):
        small.check_model(512, 30, "M")  # the model's eos is not a token of the tokenizer
    warning = small.check_model(512, 2, "M")
    assert "has 20 entries" in warning and "vocabulary of 512" in warning and small.source in warning


def test_ids_the_tokenizer_lacks_decode_visibly(tmp_path, shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer

    small = Tokenizer.from_file(_write_tokenizer(shakespeare_dataset, tmp_path / "tokenizer.json",
                                                 _twenty_entries))
    known = [i for i in range(20) if small.token_text(i) is not None and i > 2][:2]
    text = small.decode([known[0], 300, 301, known[1], -1], skip_special_tokens=True)
    assert text == (small.decode([known[0]]) + "<unk:300><unk:301>" + small.decode([known[1]]) + "<unk:-1>")
    assert small.decode(known) == small.backend.decode(known)  # the common case: the library's own decode


def test_zaya_generate_checks_the_tokenizer_against_the_model(tmp_path, shakespeare_dataset, capsys):
    from zaya.cli import main

    def bigger(spec):
        spec["added_tokens"].append({"id": 512, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})

    ckpt = _checkpoint(tmp_path / "big", bigger, shakespeare_dataset)
    args = ["generate", "--prompt", "ROMEO:", "--max-new-tokens", "6", "--device", "cpu", "--temperature", "0"]
    assert main([*args, "--checkpoint", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "has ids up to 512" in err and "vocabulary of 512" in err and str(ckpt) in err

    ckpt = _checkpoint(tmp_path / "small", _twenty_entries, shakespeare_dataset)
    # "ROMEO:" has no token among the 20 (a prompt must have one: this tokenizer puts nothing before a text).
    assert main([*args, "--checkpoint", str(ckpt), "--ignore-eos", "--prompt", "!"]) == 0
    out, err = capsys.readouterr()
    assert "warning: the tokenizer" in err and "has 20 entries" in err
    assert "<unk:" in out  # a random model's ids are mostly past the 20 the tokenizer has: shown, not dropped
