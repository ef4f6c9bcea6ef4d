"""Shared fixtures: a private cache directory for every test session, one intra-op thread, no plots at the end of
a run (but where marked), a small prepared Shakespeare dataset, the micro training config, and one micro run
trained once per session."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Built-in corpora are prepared into a session temp dir, never into the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ZAYA_CACHE_DIR", str(tmp_path_factory.mktemp("zaya-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """One intra-op thread in the test process and (OMP_NUM_THREADS) in the processes it starts, as every rank has:
    the models here are tiny, and on a busy 2-core machine the thread pool's hand-offs made them several times
    slower (tests/test_model.py: 61 s with two threads, 18 s with one)."""
    import torch

    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


def pytest_configure(config):
    config.addinivalue_line("markers", "plots: finished runs draw their PNGs (see _no_plots)")


@pytest.fixture(autouse=True)
def _no_plots(request, monkeypatch):
    """A run that finishes in the test process draws no PNGs (matplotlib: about 2 s of CPU a run, in dozens of runs
    here) unless the test is marked ``plots``: tests/test_plot.py (the drawing, `zaya plot`) and the end-to-end
    `zaya train` of tests/test_cli.py (a finished run writes them)."""
    if request.node.get_closest_marker("plots") is None:
        monkeypatch.setattr("zaya.train.plot.plot_run", lambda run_dir, out_dir=None: [])


@pytest.fixture(scope="session")
def shakespeare_dataset(tmp_path_factory):
    """The built-in corpus prepared with a 512-entry BPE (ids: pad 0, bos 1, eos 2); about 3 s, once per session."""
    from zaya.data.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("data") / "shakespeare-512"
    prepare(PrepareOptions(inputs=["builtin:shakespeare"], out=str(out), vocab_size=512, val_fraction=0.05,
                           tokenizer_sample_mb=2.0), log=lambda m: None)
    return out


MICRO_CONFIG = """
[model]
vocab_size = 512
eos_token_id = 2
hidden_size = 64
num_layers = 2
num_query_heads = 2
num_kv_heads = 2
head_dim = 32
num_experts = 4
expert_hidden_size = 128
router_hidden_size = 32
max_seq_len = 64

[data]
datasets = {{ shakespeare = "{dataset}" }}
prefetch = 2
val_batches = 2

[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2

[train]
max_steps = 6
micro_batch_size = 4
seq_len = 32
log_every = 2
eval_every = 3
sample_tokens = 8
peak_flops = 1e11
run_dir = "{run_dir}"

[checkpoint]
every = 3
ram_dir = "{run_dir}.ram"
"""


@pytest.fixture
def micro_config(tmp_path, shakespeare_dataset):
    """Write a micro training config (2 layers, d=64, 6 steps of 4 x 32 tokens); extra TOML is appended."""

    def write(run_dir=None, extra: str = "", name: str = "micro.toml"):
        path = tmp_path / name
        run_dir = run_dir or tmp_path / "run"
        path.write_text(MICRO_CONFIG.format(dataset=shakespeare_dataset, run_dir=run_dir) + extra)
        return path

    return write


MICRO_RUN_STEPS = 2


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory, shakespeare_dataset) -> Path:
    """The micro config trained for ``MICRO_RUN_STEPS`` steps with a checkpoint at each (no evaluation, no samples),
    once per session; its run directory. Tests only read it: one that alters a run alters a copy."""
    from zaya.config import load_config
    from zaya.train.trainer import train

    root = tmp_path_factory.mktemp("micro-run")
    cfg = root / "micro.toml"
    cfg.write_text(MICRO_CONFIG.format(dataset=shakespeare_dataset, run_dir=root / "run"))
    train(load_config(cfg, [f"train.max_steps={MICRO_RUN_STEPS}", "checkpoint.every=1", "train.eval_every=0",
                            "train.sample_tokens=0"]))
    return root / "run"
