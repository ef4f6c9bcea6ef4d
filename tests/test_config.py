"""Config loading: presets load, unknown keys get a suggestion, shape rules fail at load naming key and rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from zaya.config import ConfigError, ModelConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["tiny", "small", "zaya1-base", "tiny-long"])
def test_presets_load(name):
    cfg = load_config(CONFIGS / f"{name}.toml")
    assert cfg.model.num_layers >= 1


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_unknown_key_suggests_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"c\.toml \[model\]: unknown key 'num_expert'.*'num_experts'"):
        load_config(write(tmp_path, "[model]\nnum_expert = 4\n"))


def test_unknown_table_suggests_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown table \[modle\].*'model'"):
        load_config(write(tmp_path, "[modle]\nhidden_size = 4\n"))


@pytest.mark.parametrize("text,key,rule", [
    ("num_query_heads = 6\nnum_kv_heads = 4", "num_query_heads", "multiple of num_kv_heads"),
    ("head_dim = 33", "head_dim", "even for RoPE"),
    ("top_k = 17", "top_k", "must not exceed num_experts"),
    ('attention = "mha"\nnum_kv_heads = 2', "num_kv_heads", "must equal num_query_heads"),
    ("rope_fraction = 0.3", "rope_fraction", "even whole number"),
    ('router = "sinkhorn"', "router", 'must be "zaya" or "linear"'),
])
def test_shape_rules_fail_at_load(tmp_path, text, key, rule):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, f"[model]\n{text}\n"))
    assert f"model.{key}" in str(err.value) and rule in str(err.value) and "c.toml" in str(err.value)


def test_wrong_type_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"\[model\]\.hidden_size = '64': expected int"):
        load_config(write(tmp_path, '[model]\nhidden_size = "64"\n'))


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))


def test_ints_are_accepted_for_floats_and_defaults_fill_in(tmp_path):
    cfg = load_config(write(tmp_path, "[model]\nrope_theta = 1000000\n"))
    assert cfg.model.rope_theta == 1e6 and cfg.model.hidden_size == ModelConfig().hidden_size


def test_dump_and_load_round_trip(tmp_path):
    from zaya.config import dump_config

    cfg = load_config(CONFIGS / "tiny.toml")
    cfg.model.router_balance_betas = (0.8, 0.99)
    again = load_config(dump_config(cfg, tmp_path / "run" / "config.toml"))
    assert again == cfg


@pytest.mark.parametrize("text,what,nearest", [
    ("[train]\nseq_len = 30\ncontext_parallel = 2", "train.seq_len = 30", 28),  # 28 and 32 are as near: the shorter
    ("[train]\nseq_len = 129\ncontext_parallel = 2", "train.seq_len = 129", 128),
    ("[train]\nseq_len = 20\ncontext_parallel = 8", "train.seq_len = 20", 32),  # below 2 tokens a chunk: 4 x cp
    ('[train]\nseq_len = 64\n[[stages]]\nname = "long"\nseq_len = 100\ncontext_parallel = 3',
     "stage 'long': seq_len = 100", 102),
])
def test_a_seq_len_context_parallelism_cannot_split_is_refused_with_one_that_can(tmp_path, text, what, nearest):
    with pytest.raises(ConfigError, match=rf"{what} cannot be split over context_parallel.*use e\.g\. {nearest}\b"):
        load_config(write(tmp_path, text))
    fixed = text.replace(what.split(" = ")[1], str(nearest)) if "stage" in what else \
        text.replace(what.split(" = ")[1] + "\n", f"{nearest}\n")
    load_config(write(tmp_path, fixed))


def _float_fields() -> list[tuple[str, str]]:
    """Every (table, key) of the config whose value is one float (one rule covers them all: none is a list)."""
    import dataclasses
    from typing import get_type_hints

    from zaya.config import Config

    out = []
    for table in dataclasses.fields(Config):
        cls = get_type_hints(Config)[table.name]
        if not dataclasses.is_dataclass(cls):
            continue  # stages: tested below
        out += [(table.name, f.name) for f in dataclasses.fields(cls) if get_type_hints(cls)[f.name] is float]
    return out


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_field_refuses_non_finite_values(tmp_path, value):
    fields = _float_fields()
    assert len(fields) > 30 and ("optim", "lr") in fields and ("aegis", "lr_cut") in fields
    for table, key in fields:
        with pytest.raises(ConfigError) as err:
            load_config(CONFIGS / "tiny.toml", [f"{table}.{key}={value}"])
        message = str(err.value)
        assert f"[{table}].{key} = {value}: must be a finite number" in message and "default is" in message, message


@pytest.mark.parametrize("text,where", [
    ("[optim]\nlr = nan\n", "[optim].lr = nan"),
    ("[optim]\nbetas = [0.9, inf]\n", "[optim].betas[1] = inf"),
    ("[model]\nrouter_balance_betas = [-inf, 0.9]\n", "[model].router_balance_betas[0] = -inf"),
    ("[data]\nweights = { shakespeare = nan }\n", "[data].weights.shakespeare = nan"),
    ('[[stages]]\nname = "s"\nrope_theta = inf\n', "[[stages]][0].rope_theta = inf"),
    ('[[stages]]\nname = "s"\nweights = { shakespeare = -inf }\n', "[[stages]][0].weights.shakespeare = -inf"),
])
def test_non_finite_floats_in_toml_lists_and_tables_are_config_errors(tmp_path, text, where):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert "c.toml" in str(err.value) and f"{where}: must be a finite number" in str(err.value)
    finite = text.replace("-inf", "0.5").replace("inf", "0.5").replace("nan", "0.5")
    load_config(write(tmp_path, finite))


@pytest.mark.parametrize("override,needle", [
    ("optim.lr=1e300", "[optim].lr = 1e+300: must be a finite number within float32's range"),
    ("model.qk_temperature_init=-1e39", "[model].qk_temperature_init = -1e+39: must be a finite number"),
    ("optim.weight_decay=-0.1", "optim.weight_decay = -0.1: must be >= 0"),
    ("optim.betas=[1.0, 0.9]", "optim.betas = (1.0, 0.9): must be in [0, 1)"),
    ("optim.muon_momentum=-0.5", "optim.muon_momentum = -0.5: must be in [0, 1)"),
    ("optim.muon_lr=-1", "optim.muon_lr = -1.0: must be >= 0 (0 = optim.lr)"),
    ("optim.grad_clip=-1", "optim.grad_clip = -1.0: must be >= 0 (0 = no clipping)"),
    ("train.timeout_s=0", "train.timeout_s = 0.0: must be in (0, 1e+12] seconds"),
    ("train.startup_timeout_s=1e15", "train.startup_timeout_s = 1000000000000000.0: must be in (0, 1e+12]"),
])
def test_floats_the_optimizers_or_timers_cannot_take_are_config_errors(override, needle):
    """Each of these passed the config and ended in a traceback (exit 70) when the run built its optimizers, cast
    the value into a float32 tensor or made a collective's timeout."""
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.toml", [override])
    assert needle in str(err.value), str(err.value)


def _int_fields() -> list[tuple[str, str, type]]:
    """Every (table, key, class) of the config whose value is one int, stages' included."""
    import dataclasses
    from typing import get_type_hints

    from zaya.config import Config, StageConfig

    out = []
    for table in dataclasses.fields(Config):
        cls = get_type_hints(Config)[table.name]
        cls = cls if dataclasses.is_dataclass(cls) else StageConfig
        out += [(table.name, f.name, cls) for f in dataclasses.fields(cls) if get_type_hints(cls)[f.name] is int]
    return out


def test_every_int_field_has_a_range_and_refuses_values_outside_it(tmp_path):
    """One rule for every int field (its declared range, [0, 2**31) unless the field says otherwise): 10**30 as
    train.micro_batch_size ended in numpy's 'Maximum allowed size exceeded' (exit 70), eos_token_id = 10**9 in
    'input_ids hold id 1000000000'. Each message names the key, the value, the range and the default."""
    stage = write(tmp_path, '[[stages]]\nname = "s"\n')
    fields = _int_fields()
    assert len(fields) > 45 and {("train", "micro_batch_size"), ("stages", "tokens")} <= {(t, k) for t, k, _ in fields}
    for table, key, _ in fields:
        for value in (-1, 2**70):
            path = stage if table == "stages" else CONFIGS / "tiny.toml"
            override = f"{'stages.0' if table == 'stages' else table}.{key}={value}"
            with pytest.raises(ConfigError) as err:
                load_config(path, [override])
            message = str(err.value)
            assert f"].{key} = {value}: must be an integer in [" in message and "default is" in message, message


@pytest.mark.parametrize("override,needle", [
    ("train.micro_batch_size=1000000000000000000000000000000",
     "[train].micro_batch_size = 1000000000000000000000000000000: must be an integer in [1, 2**31); write one in "
     "that range (the default is 16)"),
    ("model.num_layers=0", "[model].num_layers = 0: must be an integer in [1, 4096)"),
    ("model.head_dim=-64", "[model].head_dim = -64: must be an integer in [1, 2**31)"),
    ("model.eos_token_id=4096", "[model].eos_token_id = 4096: must be an integer in [0, vocab_size = 4096)"),
    ("model.bos_token_id=-1", "[model].bos_token_id = -1: must be an integer in [0, vocab_size = 4096)"),
    ("train.seed=4294967296", "[train].seed = 4294967296: must be an integer in [0, 2**32)"),  # numpy's limit
    ("train.batch_ramp=[[-5, 64]]", "train.batch_ramp = [(-5, 64)]: tokens_seen must increase within [0, 2**53)"),
    ("train.batch_ramp=[[0, 4294967296]]", "batches lie in [1, 2**31)"),
])
def test_int_ranges_name_key_value_range_and_default(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.toml", [override])
    assert needle in str(err.value), str(err.value)


def test_token_ids_lie_below_the_vocabulary_set_in_the_same_table(tmp_path):
    with pytest.raises(ConfigError, match=r"eos_token_id = 64: must be an integer in \[0, vocab_size = 64\)"):
        load_config(write(tmp_path, "[model]\nvocab_size = 64\neos_token_id = 64\n"))
    assert load_config(write(tmp_path, "[model]\nvocab_size = 64\neos_token_id = 63\n")).model.eos_token_id == 63


@pytest.mark.parametrize("key,value", [("eos_token_id", -1), ("eos_token_id", 10**9), ("eos_token_id", 2**70),
                                       ("num_layers", 2**70), ("hidden_size", 0), ("num_experts", -4)])
def test_a_checkpoints_model_config_goes_through_the_same_ranges(key, value):
    """The loaders (zaya checkpoints' meta.json, Hugging Face config.json, training checkpoints) build their model
    config with model_config_from_dict, which checks the ranges a TOML file's values get."""
    from zaya.config import model_config_from_dict, to_dict

    data = to_dict(ModelConfig(vocab_size=512, eos_token_id=2))
    model_config_from_dict(data, "ckpt/meta.json [model]")
    data[key] = value
    with pytest.raises(ConfigError) as err:
        model_config_from_dict(data, "ckpt/meta.json [model]")
    assert str(err.value).startswith(f"ckpt/meta.json [model].{key} = {value}: must be an integer in [")


def test_zaya_train_refuses_a_huge_micro_batch_with_exit_2(tmp_path, capsys):
    """End to end through the CLI's main (in this process: a `zaya` subprocess only adds a torch start-up): the
    audit's --set train.micro_batch_size=10**30 exited 70 with numpy's traceback."""
    from zaya.cli import main

    code = main(["train", "--config", str(CONFIGS / "tiny.toml"), "--run-dir", str(tmp_path / "run"), "--set",
                 "train.micro_batch_size=1000000000000000000000000000000"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "micro_batch_size = 1000000000000000000000000000000" in err
    assert not (tmp_path / "run").exists()
