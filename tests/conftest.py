"""Shared fixtures: a private cache directory for every test session, and a small prepared Shakespeare dataset."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Built-in corpora are prepared into a session temp dir, never into the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ZAYA_CACHE_DIR", str(tmp_path_factory.mktemp("zaya-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def shakespeare_dataset(tmp_path_factory):
    """The built-in corpus prepared with a 512-entry BPE (ids: pad 0, bos 1, eos 2); about 3 s, once per session."""
    from zaya.data.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("data") / "shakespeare-512"
    prepare(PrepareOptions(inputs=["builtin:shakespeare"], out=str(out), vocab_size=512, val_fraction=0.05,
                           tokenizer_sample_mb=2.0), log=lambda m: None)
    return out
