"""The Hugging Face ``zaya`` layout: logits parity with transformers' own ZayaForCausalLM, loading (single file and
sharded), lossless conversion both ways, and the errors a bad checkpoint or destination gives.

Two traps shape these tests:

- default initialisation (unit scales, zero biases, zero key temperatures, default balancing biases) hides most
  wiring mistakes, so ``perturb_hf`` moves EVERY parameter and buffer off its init, and ``calibrate_routing`` sets
  the balancing biases so that each layer spreads tokens over several experts and some layers send a share of the
  tokens to the skip class (asserted, not assumed);
- ``transformers``' ``from_pretrained`` re-initialises the routers' ``balancing_biases`` although the file holds
  them, so parity is checked against the perturbed HF model in memory (saved with ``save_pretrained``, loaded with
  ``zaya.load_pretrained``), and where a file written by zaya is loaded by transformers the biases are copied back
  by hand before comparing.

Tolerance: 1e-4 absolute on fp32 logits of magnitude ~10 (the issue's bar); measured differences are ~1e-5.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.zaya")

from model_helpers import tiny_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import ZayaConfig  # noqa: E402
from transformers import ZayaForCausalLM as HFZaya  # noqa: E402

import zaya  # noqa: E402
import zaya.model.hf as zhf  # noqa: E402
import zaya.model.io as zio  # noqa: E402
from zaya.config import ConfigError  # noqa: E402
from zaya.model import ZayaForCausalLM  # noqa: E402

TOL = 1e-4
VOCAB = 128


# ------------------------------------------------------------------------------------------------------ helpers
def convert(src, dst, to: str, dtype: str = "keep", overwrite: bool = False) -> Path:
    """Between the zaya and Hugging Face layouts (``to`` = "hf" or "zaya"): ``zaya export`` in that format."""
    from zaya.checkpoint.export import export

    return export(src, dst, format="hf" if to == "hf" else "safetensors", dtype=dtype, overwrite=overwrite)


def hf_config(**overrides) -> ZayaConfig:
    values = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32, router_hidden_size=16,
                  max_position_embeddings=64, attn_implementation="sdpa")
    values.update(overrides)
    return ZayaConfig(**values)


@torch.no_grad()
def perturb_hf(model: torch.nn.Module, seed: int) -> None:
    """Random values for every parameter and buffer (RoPE tables excepted), at magnitudes that keep activations
    O(1): 1-D scales / norm weights 1 +- 0.2, 1-D biases +- 0.1, key temperatures in [1, 3], matrices and convs
    ~ N(0, 1/fan_in), embeddings N(0, 0.25), router output projection 4x larger so router probabilities vary."""
    g = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name:
            continue
        r = torch.randn(p.shape, generator=g)
        if name.endswith("balancing_biases"):
            p.copy_(0.05 * r)
        elif name.endswith("qk_norm.temp"):
            p.copy_(1.0 + 2.0 * torch.rand(p.shape, generator=g))
        elif p.dim() == 1 and ("scale" in name or name.endswith("norm.weight") or name.endswith("layernorm.weight")):
            p.copy_(1.0 + 0.2 * r)
        elif p.dim() == 1:
            p.copy_(0.1 * r)
        elif "embed_tokens" in name or name == "lm_head.weight":
            p.copy_(0.5 * r)
        elif "router_mlp.out_proj" in name:
            p.copy_(4.0 * r / math.sqrt(p.shape[-1]))
        else:
            fan_in = p.shape[1] * p.shape[2] if "conv" in name else p.shape[-1]
            p.copy_(r / math.sqrt(fan_in))


@torch.no_grad()
def calibrate_routing(model: HFZaya, ids: torch.Tensor, skip_layers: tuple[int, ...]) -> None:
    """Set each layer's balancing biases from the router probabilities on ``ids`` (layer by layer, since a layer's
    choices change the next layer's input): real experts get minus their mean probability, so tokens spread over
    the experts; in ``skip_layers`` the skip class gets a bias halfway between two tokens' margins so that about
    a third of the tokens (and no token on the boundary) go to the skip class; elsewhere it gets -1."""
    e = model.config.num_experts
    for i, layer in enumerate(model.model.layers):
        bias = layer.mlp.gate.balancing_biases
        probs = model(ids, output_router_logits=True).router_logits[i].float().softmax(-1)
        bias[:e] = -probs[:, :e].mean(0)
        bias[e] = -1.0
        if i in skip_layers:
            margin = ((probs[:, :e] + bias[:e]).max(-1).values - probs[:, e]).sort().values
            k = len(margin) // 3
            bias[e] = (margin[k - 1] + margin[k]) / 2


def make_hf_model(seed: int = 0, skip_layers: tuple[int, ...] = (1,), **overrides) -> HFZaya:
    torch.manual_seed(seed)
    model = HFZaya(hf_config(**overrides)).eval()
    perturb_hf(model, seed + 1)
    calibrate_routing(model, input_batch()[0], skip_layers)
    return model


def input_batch(batch: int = 3, seq: int = 12, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and a left-padding mask (row 0 unpadded, the others padded by 4 and 7)."""
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, pad in zip(range(1, batch), (4, 7)):
        mask[row, :pad] = 0
    return ids, mask


def balancing_biases_hf(model: HFZaya) -> list[torch.Tensor]:
    return [layer.mlp.gate.balancing_biases.detach().clone() for layer in model.model.layers]


def balancing_biases_zaya(model: ZayaForCausalLM) -> list[torch.Tensor]:
    return [block.moe.router.balancing_biases.detach().clone() for block in model.blocks]


def read_dir_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``directory`` (side files included), keyed by file-less name."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            key = f"{f.name}:{name}" if f.name == zhf.EXTRAS_FILE else name
            assert key not in out, key
            out[key] = t
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def routing_counts(model: ZayaForCausalLM, ids, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask).tokens_per_expert


def assert_routing_nontrivial(counts: torch.Tensor, num_experts: int, skip_layers: tuple[int, ...]) -> None:
    """Every layer uses at least two experts; the skip layers send some but not all tokens to the skip class."""
    for layer, row in enumerate(counts):
        assert int((row[:num_experts] > 0).sum()) >= 2, (layer, row.tolist())
        if layer in skip_layers:
            assert 0 < int(row[num_experts]) < int(row.sum()), (layer, row.tolist())


def no_temp_dirs(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".tmp-" in p.name or p.name.endswith(".old")]


# ------------------------------------------------------------------------------------------------------ parity
PARITY_CASES = [
    pytest.param(dict(attn_implementation="sdpa"), id="sdpa-4q2kv-tied"),
    pytest.param(dict(attn_implementation="eager"), id="eager-4q2kv-tied"),
    pytest.param(dict(attn_implementation="sdpa", num_attention_heads=8, num_key_value_heads=4,
                      tie_word_embeddings=False), id="sdpa-8q4kv-untied"),
]


@pytest.mark.parametrize("overrides", PARITY_CASES)
def test_logits_match_transformers(tmp_path, overrides):
    hf = make_hf_model(**overrides)
    assert hf.config._attn_implementation == overrides["attn_implementation"]
    saved_biases = balancing_biases_hf(hf)
    hf.save_pretrained(tmp_path / "hf")
    ours = zaya.load_pretrained(tmp_path / "hf")
    assert not ours.training
    assert ours.config.tie_embeddings == hf.config.tie_word_embeddings

    # The loader keeps the balancing biases from the file (transformers' own from_pretrained re-initialises them).
    for got, want in zip(balancing_biases_zaya(ours), saved_biases):
        assert torch.equal(got, want)

    ids, mask = input_batch()
    e = hf.config.num_experts
    assert_routing_nontrivial(routing_counts(ours, ids), e, skip_layers=(1,))
    assert int(routing_counts(ours, ids, mask)[:, e].sum()) > 0

    with torch.no_grad():
        # (a) no padding
        diff = (hf(ids).logits - ours(ids).logits).abs().max().item()
        assert diff < TOL, diff
        # (a') explicit, offset position ids
        pos = torch.arange(3, 3 + ids.shape[1])[None].expand_as(ids)
        diff = (hf(ids, position_ids=pos).logits - ours(ids, position_ids=pos).logits).abs().max().item()
        assert diff < TOL, diff
        # (b) left padding: only real-token positions are compared. What HF gives at padding positions depends on
        # the attention backend (eager lets a fully masked query attend uniformly, sdpa does not) and is never used.
        real = mask.bool()
        want = hf(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        diff = (want - got)[real].abs().max().item()
        assert diff < TOL, diff
        assert torch.isfinite(got).all()
        # Padding positions influence nothing: other ids under the padding leave the real logits as they are (up to
        # rounding: the experts' matmuls see different row groups when padding tokens route differently).
        other = torch.where(real, ids, (ids + 17) % VOCAB)
        diff = (ours(other, attention_mask=mask).logits - got)[real].abs().max().item()
        assert diff < 1e-5, diff
        # Padded rows equal the same rows run alone without padding, up to rounding (RoPE positions differ only by
        # a constant shift, which attention scores do not see).
        alone = ours(ids[2:, 7:]).logits
        assert (alone - got[2:, 7:]).abs().max().item() < TOL


def test_loader_keeps_balancing_biases_through_conversion(tmp_path):
    hf = make_hf_model()
    saved = balancing_biases_hf(hf)
    hf.save_pretrained(tmp_path / "hf")
    # In the file ...
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        for i, want in enumerate(saved):
            assert torch.equal(f.get_tensor(f"model.layers.{i}.mlp.gate.balancing_biases"), want)
    # ... through HF -> zaya -> HF ...
    convert(tmp_path / "hf", tmp_path / "zaya", to="zaya")
    for got, want in zip(balancing_biases_zaya(zaya.load_pretrained(tmp_path / "zaya")), saved):
        assert torch.equal(got, want)
    convert(tmp_path / "zaya", tmp_path / "hf2", to="hf")
    for got, want in zip(balancing_biases_zaya(zaya.load_pretrained(tmp_path / "hf2")), saved):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------------ sharding
def test_sharded_checkpoints_both_ways(tmp_path):
    hf = make_hf_model(tie_word_embeddings=False)
    ids, mask = input_batch()
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()

    single = zaya.load_pretrained(tmp_path / "single")
    sharded = zaya.load_pretrained(tmp_path / "sharded")
    assert_same_tensors(single.state_dict(), sharded.state_dict())
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        diff = (want - sharded(ids, attention_mask=mask).logits)[mask.bool()].abs().max().item()
    assert diff < TOL, diff

    # zaya writes shards that transformers loads (nothing missing or unexpected) and zaya reads back bit-exactly.
    zhf.save_hf(sharded, tmp_path / "ours", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and all((tmp_path / "ours" / f).is_file() for f in files)
    assert_same_tensors(zaya.load_pretrained(tmp_path / "ours").state_dict(), sharded.state_dict())

    reloaded, info = HFZaya.from_pretrained(tmp_path / "ours", output_loading_info=True,
                                            attn_implementation="sdpa")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reloaded.eval()
    with torch.no_grad():
        # from_pretrained re-initialises the balancing biases: put the saved ones back by hand.
        for layer, bias in zip(reloaded.model.layers, balancing_biases_zaya(sharded)):
            layer.mlp.gate.balancing_biases.copy_(bias)
        for name, t in hf.state_dict().items():
            assert torch.equal(reloaded.state_dict()[name], t), name
        got = reloaded(ids, attention_mask=mask).logits
        diff = (got - sharded(ids, attention_mask=mask).logits)[mask.bool()].abs().max().item()
    assert diff < TOL, diff


# ------------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hf_zaya_hf_round_trip_is_bit_exact(tmp_path, dtype):
    # The bf16 case also has untied embeddings, a null pad token and a list of eos tokens (all kept as written).
    extra = {} if dtype == torch.float32 else dict(tie_word_embeddings=False, pad_token_id=None, eos_token_id=[106, 1])
    hf = make_hf_model(**extra).to(dtype)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "zaya", to="zaya")
    convert(tmp_path / "zaya", tmp_path / "back", to="hf")

    original = read_dir_tensors(tmp_path / "hf")
    back = read_dir_tensors(tmp_path / "back")
    # The only addition is zaya's side file (router moment estimates, zaya-only options), which transformers ignores.
    extras = {k: back.pop(k) for k in list(back) if k.startswith(zhf.EXTRAS_FILE)}
    assert extras
    assert_same_tensors(original, back)
    assert {t.dtype for t in back.values()} == {dtype}
    # config.json comes back key for key, transformers_version and HF-only keys (sliding_window,
    # output_router_logits, use_cache, the hybrid_sliding RoPE entry ...) included; so does generation_config.json.
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "back" / name).read_text()) == json.loads((tmp_path / "hf" / name).read_text())
    # zaya's own layout holds the same tensors under zaya's names, in the stored dtype.
    model = zaya.load_pretrained(tmp_path / "zaya")
    assert model.embed.weight.dtype == dtype


def native_zaya_model(dtype: torch.dtype = torch.float32) -> ZayaForCausalLM:
    """A zaya-made model with non-default zaya-only options and state (moment estimates, step count)."""
    model = tiny_model(3, vocab_size=VOCAB, hidden_size=32, num_layers=2, head_dim=8, num_experts=3,
                       expert_hidden_size=16, router_hidden_size=8, max_seq_len=32, router_balance_lr=3e-3,
                       router_skip_bias_init=-0.5, qk_temperature_init=2.0, moe_impl="loop", residual_fp32=False,
                       rope_theta=12345.0, init_std=0.03, eos_token_id=7)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" not in name:
                t.copy_(torch.randn(t.shape, generator=g).abs() + 0.5 if "step" in name
                        else torch.randn(t.shape, generator=g))
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zaya_hf_zaya_round_trip_is_bit_exact(tmp_path, dtype):
    model = native_zaya_model(dtype)
    zio.save_checkpoint(model, tmp_path / "zaya")
    convert(tmp_path / "zaya", tmp_path / "hf", to="hf")
    convert(tmp_path / "hf", tmp_path / "back", to="zaya")
    assert_same_tensors(load_file(str(tmp_path / "zaya" / "model.safetensors")),
                        load_file(str(tmp_path / "back" / "model.safetensors")))
    first = json.loads((tmp_path / "zaya" / "zaya.json").read_text())
    again = json.loads((tmp_path / "back" / "zaya.json").read_text())
    # The model config (zaya-only options such as residual_fp32 and moe_impl included) comes back unchanged; the
    # second copy also records the config.json it passed through, so that converting to HF again reproduces it.
    assert again.pop("hf_config") == json.loads((tmp_path / "hf" / "config.json").read_text())
    assert first == again
    # transformers reads the exported config.json.
    assert ZayaConfig.from_pretrained(tmp_path / "hf").num_hidden_layers == 2


def test_convert_to_other_dtype(tmp_path):
    hf = make_hf_model().to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "f32", to="hf", dtype="float32")
    config = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert config["dtype"] == "float32"
    tensors = read_dir_tensors(tmp_path / "f32")
    for name, t in read_dir_tensors(tmp_path / "hf").items():
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], t.float()), name


# ------------------------------------------------------------------------------------------------------ errors
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hfdir") / "hf"
    make_hf_model().save_pretrained(d)
    return d


def copy_dir(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None,
             config: dict | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path, hf_dir):
    tensors = load_file(str(hf_dir / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name][:, :48].contiguous()
    bad = copy_dir(hf_dir, tmp_path / "bad", tensors=tensors)
    with pytest.raises(ValueError) as err:
        zaya.load_pretrained(bad)
    msg = str(err.value)
    assert name in msg and "(64, 48)" in msg and "(64, 64)" in msg, msg


def test_missing_tensor_is_named(tmp_path, hf_dir):
    tensors = load_file(str(hf_dir / "model.safetensors"))
    name = "model.layers.2.mlp.gate.router_mlp.fc2.bias"
    del tensors[name]
    bad = copy_dir(hf_dir, tmp_path / "bad", tensors=tensors)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        zaya.load_pretrained(bad)


def test_unexpected_tensor_is_named(tmp_path, hf_dir):
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    bad = copy_dir(hf_dir, tmp_path / "bad", tensors=tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        zaya.load_pretrained(bad)


@pytest.mark.parametrize("key, value", [
    ("layer_types", ["hybrid", "hybrid_sliding", "hybrid"]),
    ("hidden_act", "gelu"),
    ("attention_bias", True),
    ("lm_head_bias", True),
    ("rope_parameters", {"hybrid": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}),
])
def test_unsupported_config_option_is_named(tmp_path, hf_dir, key, value):
    config = json.loads((hf_dir / "config.json").read_text())
    config[key] = value
    if key == "layer_types":
        config["sliding_window"] = 8
    bad = copy_dir(hf_dir, tmp_path / "bad", config=config)
    with pytest.raises(ConfigError, match=key):
        zaya.load_pretrained(bad)


def test_convert_refuses_existing_destination(tmp_path, hf_dir):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    for to in ("zaya", "hf"):
        with pytest.raises(FileExistsError):
            convert(hf_dir, dst, to=to)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "precious"
    assert no_temp_dirs(tmp_path)
    convert(hf_dir, dst, to="zaya", overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["SHA256SUMS", "model.safetensors", "zaya.json"]
    assert no_temp_dirs(tmp_path)


@pytest.mark.parametrize("to", ["hf", "zaya"])
def test_failed_conversion_leaves_nothing_behind(tmp_path, hf_dir, monkeypatch, to):
    real_save = zio.save_file  # both formats write their safetensors through zaya.model.io.save_safetensors
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        real_save(tensors, path, metadata=metadata)  # a file is half the job: fail after writing it
        raise OSError("disk full (injected)")

    src = tmp_path / "src"
    convert(hf_dir, src, to="hf" if to == "zaya" else "zaya")
    monkeypatch.setattr(zio, "save_file", failing_save)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OSError, match="injected"):
        convert(src, out / "dst", to=to)
    assert calls and list(out.iterdir()) == []

    # Overwriting a good destination that then fails keeps the old one intact.
    monkeypatch.setattr(zio, "save_file", real_save)
    convert(src, out / "dst", to=to)
    before = {p.name: p.read_bytes() for p in (out / "dst").iterdir()}
    monkeypatch.setattr(zio, "save_file", failing_save)
    with pytest.raises(OSError, match="injected"):
        convert(src, out / "dst", to=to, overwrite=True)
    assert {p.name: p.read_bytes() for p in (out / "dst").iterdir()} == before
    assert [p.name for p in out.iterdir()] == ["dst"]


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_convert(tmp_path, hf_dir, capsys):
    cli = pytest.importorskip("zaya.cli")
    assert cli.main(["convert", "--to", "zaya", "--src", str(hf_dir), "--dst", str(tmp_path / "z")]) == 0
    assert cli.main(["convert", "--to", "hf", "--src", str(tmp_path / "z"), "--dst", str(tmp_path / "h")]) == 0
    assert_same_tensors(load_file(str(hf_dir / "model.safetensors")),
                        load_file(str(tmp_path / "h" / "model.safetensors")))
    # An existing destination without --force is a one-line error, and the destination is untouched.
    before = (tmp_path / "h" / "config.json").read_bytes()
    capsys.readouterr()
    assert cli.main(["convert", "--to", "hf", "--src", str(tmp_path / "z"), "--dst", str(tmp_path / "h")]) != 0
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "h" / "config.json").read_bytes() == before
    assert cli.main(["convert", "--to", "hf", "--src", str(tmp_path / "z"), "--dst", str(tmp_path / "h"),
                     "--force"]) == 0
