"""Data: tokenizers, the bundled token-shard format, ``zaya data prepare``, and the packed resumable loader.

Heavy imports stay inside the submodules; ``import zaya.data`` is cheap (the loader imports torch lazily).
"""

from zaya.data.bundle import Bundle, BundleWriter, DatasetError, PreparedDataset
from zaya.data.corpus import corpus_files, load_corpus_text
from zaya.data.loader import Batch, DataLoader, Permutation, Stage, check_vocabulary, validation_batches
from zaya.data.tokenizer import Tokenizer, TokenizerError

__all__ = ["Batch", "Bundle", "BundleWriter", "DataLoader", "DatasetError", "Permutation",
           "PreparedDataset", "Stage", "Tokenizer", "TokenizerError", "check_vocabulary", "corpus_files",
           "load_corpus_text", "validation_batches"]
