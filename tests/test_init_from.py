"""``train.init_from``: a new run from the weights of a transformers-made ``ZayaForCausalLM`` (sharded, with an
index), a zaya export and a zaya run. Its loss before any update is `zaya eval`'s of the source; a model key that
contradicts the source is refused; the tokenizer must be the data's; a run with checkpoints of its own resumes; a
finished run says so and touches nothing; under FSDP2 each rank reads only its own shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from zaya.cli import main
from zaya.config import load_config
from zaya.core.errors import ConfigError

from dist_helpers import run_ok

TOL = 1e-4  # fp32 on both sides; the trainer and `zaya eval` run one code path (eval.perplexity) on the same batches

RUN_CONFIG = """
[data]
datasets = {{ shakespeare = "{dataset}" }}
prefetch = 0
val_batches = 1

[optim]
lr = 1e-3
warmup_steps = 1

[train]
max_steps = 1
micro_batch_size = 4
seq_len = 32
dtype = "float32"
eval_every = 1
sample_tokens = 0
router_probe = false
peak_flops = 1e11
run_dir = "{run_dir}"

[checkpoint]
async_save = false
ram_tier = false
"""


@pytest.fixture(autouse=True)
def plots(monkeypatch) -> list:
    """The runs' plot calls, recorded instead of drawn (matplotlib takes seconds per run here)."""
    calls: list = []
    monkeypatch.setattr("zaya.train.plot.plot_run", lambda run_dir: calls.append(run_dir) or [])
    return calls


def write_config(tmp_path: Path, dataset: Path, extra: str = "", name: str = "init.toml") -> Path:
    path = tmp_path / name
    path.write_text(RUN_CONFIG.format(dataset=dataset, run_dir=tmp_path / "run") + extra)
    return path


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> Path:
    """A random transformers ``ZayaForCausalLM`` of an unusual shape (odd width, 5 query heads over 1 KV head, 3
    experts, untied head), for the shakespeare tokenizer's 512 ids, saved in 20 KB shards with an index."""
    from transformers import ZayaConfig, ZayaForCausalLM

    torch.manual_seed(0)
    config = ZayaConfig(vocab_size=512, hidden_size=40, num_hidden_layers=2, num_attention_heads=5,
                        num_key_value_heads=1, head_dim=8, num_experts=3,
                        moe_intermediate_size=24, router_hidden_size=12, max_position_embeddings=64,
                        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = ZayaForCausalLM(config)
    with torch.no_grad():  # transformers starts the key temperatures at 0 (uniform attention); make them matter
        for name, p in model.named_parameters():
            if name.endswith("qk_norm.temp"):
                p.uniform_(1.0, 3.0)
    out = tmp_path_factory.mktemp("hf") / "hf"
    model.save_pretrained(out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 2
    return out


@pytest.fixture(scope="module")
def export_source(tmp_path_factory, micro_run) -> Path:
    from zaya.checkpoint.export import export

    return export(micro_run, tmp_path_factory.mktemp("export") / "export", format="safetensors")


def eval_loss(capsys, source: Path, dataset: Path) -> float:
    """`zaya eval` of ``source`` on the batches the trainer validates on (4 x 32 tokens, 1 batch, fp32)."""
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(source), "--data", str(dataset), "--seq-len", "32", "--batch-size", "4",
                 "--max-batches", "1", "--dtype", "float32", "--device", "cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]


@pytest.mark.parametrize("kind", ["hf", "export", "run"])
def test_first_validation_loss_is_the_sources(kind, tmp_path, capsys, request, shakespeare_dataset):
    """The loss at step 0 (before any update) through the trainer's own validation equals `zaya eval`'s of the
    source; the model config, the balancing state and the tokenizer come with the weights."""
    from zaya.checkpoint.consolidate import load_for_inference
    from zaya.train.callbacks import Callback
    from zaya.train.trainer import train

    class AtStart(Callback):
        def on_start(self, trainer):
            self.state = {k: v.clone() for k, v in trainer.parallel.model.state_dict().items()}

    source = request.getfixturevalue({"hf": "hf_source", "export": "export_source", "run": "micro_run"}[kind])
    at_start = AtStart()
    summary = train(load_config(write_config(tmp_path, shakespeare_dataset),
                                [f"train.init_from={json.dumps(str(source))}"]), callbacks=[at_start])
    assert summary["first_val_loss"] == pytest.approx(eval_loss(capsys, source, shakespeare_dataset), abs=TOL)
    assert summary["resumed_from"] is None and summary["step"] == 1
    run = load_config(tmp_path / "run" / "config.toml")
    src, tokenizer, _ = load_for_inference(source)
    assert run.train.init_from == str(source) and run.model == src.config
    # Weights and balancing state as stored (a HF download has only the biases: the rule's state starts fresh,
    # as load_for_inference starts it)
    assert at_start.state.keys() == src.state_dict().keys()
    for name, tensor in src.state_dict().items():
        assert torch.equal(at_start.state[name], tensor), name
    if kind != "hf":
        assert (tmp_path / "run" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()


def test_a_contradicting_model_key_is_refused_and_a_settable_one_is_taken(tmp_path, hf_source, shakespeare_dataset):
    from zaya.distributed.runtime import Runtime
    from zaya.train.trainer import Trainer

    cfg = write_config(tmp_path, shakespeare_dataset, f'\n[model]\nhidden_size = 64\nmax_seq_len = 48\n')
    with pytest.raises(ConfigError, match=r"model.hidden_size = 64 contradicts .* hidden_size = 40.*remove "
                                          r"model.hidden_size"):
        Trainer.build(load_config(cfg, [f"train.init_from={json.dumps(str(hf_source))}"]), Runtime())
    cfg = write_config(tmp_path, shakespeare_dataset, f'\n[model]\nhidden_size = 40\nmax_seq_len = 48\n')
    trainer = Trainer.build(load_config(cfg, [f"train.init_from={json.dumps(str(hf_source))}"]), Runtime())
    try:
        assert trainer.config.model.max_seq_len == 48 and trainer.config.model.num_query_heads == 5
    finally:
        trainer.close()


def test_data_of_another_tokenizer_is_refused(tmp_path, hf_source, shakespeare_dataset):
    from data_helpers import tiny_tokenizer

    from zaya.train.trainer import train

    source = tmp_path / "hf"
    shutil.copytree(hf_source, source)
    tiny_tokenizer().save(source / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"data.datasets.shakespeare .* another tokenizer .*zaya data prepare "
                                          r"--tokenizer"):
        train(load_config(write_config(tmp_path, shakespeare_dataset), [f"train.init_from={json.dumps(str(source))}"]))


def test_an_interrupted_run_resumes_and_a_finished_one_exits_untouched(tmp_path, capsys, plots, export_source,
                                                                       shakespeare_dataset):
    """A run with checkpoints resumes from them (init_from ignored); one whose final step is checkpointed says so
    and exits 0 without writing a byte of metrics.jsonl."""
    cfg = str(write_config(tmp_path, shakespeare_dataset))
    args = ["train", "--config", cfg, "--init-from", str(export_source), "--device", "cpu"]
    assert main(args) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_bytes()
    assert len(plots) == 1
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr()
    assert metrics.read_bytes() == before and len(plots) == 1
    said = out.out + out.err
    assert f"{tmp_path / 'run'} has finished" in said and "--max-steps" in said and "--init-from" in said
    assert main(args + ["--max-steps", "2"]) == 0
    said = "".join(capsys.readouterr())
    assert "train.init_from ignored" in said and "resumed from" in said
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]


# --- two ranks under FSDP2 ---------------------------------------------------------------------------------------
class _Counting:
    """``safe_open`` that counts the elements read (whole tensors and slices)."""

    read = 0

    def __init__(self, real):
        self.real = real

    def __enter__(self):
        self.f = self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        _Counting.read += t.numel()
        return t

    def get_slice(self, name):
        sl = self.f.get_slice(name)

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, index):
                t = sl[index]
                _Counting.read += t.numel()
                return t

        return Slice()


def fsdp_init(rank: int, world: int, config_path: str, source: str):
    import zaya.checkpoint.init_from as init_from
    from zaya.checkpoint.init_from import load_weights, merged_model_config, open_source
    from zaya.distributed.runtime import start, stop
    from zaya.train.build import build_model

    real = init_from.safe_open
    init_from.safe_open = lambda *a, **k: _Counting(real(*a, **k))
    init_from.READ_CHUNK_BYTES = 1024  # several row blocks per tensor (the one process reads each in one)
    rt = start(60.0, 60.0, "cpu")
    try:
        cfg = load_config(config_path, ["train.parallel=\"fsdp\""])
        init = open_source(source, rt, print)
        _Counting.read = 0  # rank 0 read headers only; from here on: the weights
        from dataclasses import replace

        cfg = replace(cfg, model=merged_model_config(cfg.model, init))
        parallel = build_model(cfg, rt, weights_later=True)
        load_weights(init, parallel.wrapped, rt)
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                 for k, v in parallel.model.state_dict().items()}
        return state, _Counting.read
    finally:
        stop(rt)


def test_fsdp_ranks_read_only_their_shards_and_load_what_one_process_does(tmp_path, hf_source, shakespeare_dataset):
    from zaya.checkpoint.init_from import load_weights, merged_model_config, open_source
    from zaya.distributed.runtime import Runtime
    from zaya.train.build import build_model

    cfg = write_config(tmp_path, shakespeare_dataset)
    (state0, read0), (state1, read1) = run_ok(fsdp_init, 2, str(cfg), str(hf_source))
    rt = Runtime()
    init = open_source(str(hf_source), rt, print)
    from dataclasses import replace

    one = build_model(replace(load_config(cfg), model=merged_model_config(load_config(cfg).model, init)), rt,
                      weights_later=True)
    load_weights(init, one.wrapped, rt)
    reference = one.model.state_dict()
    assert state0.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(state0[k], v) and torch.equal(state1[k], v), k
    from safetensors import safe_open

    total = replicated = 0  # FSDP2 shards the parameters; buffers (the balancing biases) are whole on every rank
    for file in hf_source.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                n = torch.Size(f.get_slice(name).get_shape()).numel()
                total += n
                replicated += n if name.endswith("balancing_biases") else 0
    assert replicated > 0 and read0 + read1 == total + replicated
    assert max(read0, read1) < 0.55 * total
