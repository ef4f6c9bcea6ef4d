"""Data: the built-in demo corpus and tokenizers (bundles and loaders come later)."""

from zaya.data.corpus import ByteTokenizer, corpus_files, load_corpus_text

__all__ = ["ByteTokenizer", "corpus_files", "load_corpus_text"]
