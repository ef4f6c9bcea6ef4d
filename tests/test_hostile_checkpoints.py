"""Checkpoints and exports as an attacker or an unlucky operator makes them: loading never runs code from a file, an
export checks itself, a malformed file is a one-line CheckpointError (exit 5) naming it and the fix, and inference
falls back to the previous checkpoint of a run as training does.

- A `.metadata` that pickles a call (os.system, exec, one hidden deep inside a real metadata), changes a class or a
  function of torch for the whole process, declares a bytes item or points a tensor at a file outside the checkpoint,
  with the COMMIT checksums recomputed so that it passes verification, is refused by every entry point (train resume
  through the store, load_for_inference, `zaya generate` in a subprocess, `zaya export`, `zaya.load_pretrained`);
  each code-running payload is first shown to run under plain `pickle.load`, and its marker file never appears.
- Exports carry SHA256SUMS: a flipped bit is named by the checksum. Without a manifest (a Hugging Face directory from
  elsewhere) 0-byte, truncated, header-corrupt, lying-offset, int32, misshapen, missing/extra-tensor and NaN files,
  and a sharded index pointing at a missing shard or the wrong one, are each refused naming the file.
- Exported files are 0644 and directories 0755 under umask 022 (and follow another umask).

One micro run (2 steps, a checkpoint at each) and its two exports are made once for the module."""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import os
import pickle
import shutil
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zaya
from test_export import train_micro_run
from zaya.checkpoint.commit import FileRecord, checksum_file, read_commit, write_commit
from zaya.checkpoint.consolidate import load_for_inference
from zaya.checkpoint.export import export
from zaya.cli import main
from zaya.errors import CheckpointError
from zaya.model.checksums import MANIFEST, write_checksums

STEPS = 2


# ------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def run(tmp_path_factory, shakespeare_dataset) -> Path:
    return train_micro_run(tmp_path_factory.mktemp("hostile"), shakespeare_dataset, STEPS, "checkpoint.every=1")


@pytest.fixture(scope="module")
def exports(run, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {fmt: export(run, root / fmt, format=fmt) for fmt in ("hf", "safetensors")}


def step_dir(run: Path, step: int = STEPS) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def copy_run(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("zaya: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def recommit(step: Path) -> None:
    """Recompute the COMMIT record of every file (what whoever altered them can always do)."""
    records = read_commit(step)
    fresh = {name: FileRecord((step / name).stat().st_size, r.algorithm, checksum_file(step / name, r.algorithm))
             for name, r in records.items()}
    write_commit(step, int(step.name.split("-")[1]), fresh)


# ------------------------------------------------------------------------------------- payloads for .metadata
class Call:
    """Pickles as a call of ``fn(*args)``: what a crafted file asks the unpickler to do."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def real_metadata(step: Path):
    with open(step / ".metadata", "rb") as fh:
        return pickle.load(fh)  # the run's own file, written by this test


def payload(kind: str, step: Path, marker: Path) -> bytes:
    touch = f"open({str(marker)!r}, 'w').close()"
    if kind == "os.system":
        return pickle.dumps(Call(os.system, f"touch {marker}"), protocol=4)
    if kind == "exec":
        return pickle.dumps(Call(builtins.exec, touch), protocol=4)
    if kind == "hidden-in-real-metadata":  # a valid metadata whose storage_meta carries the call
        md = real_metadata(step)
        md.storage_meta.modules = ["model", Call(builtins.eval, touch)]
        return pickle.dumps(md)
    if kind == "bytes-item":  # an entry declared as a pickled object, which torch would torch.load unsafely
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md = real_metadata(step)
        md.state_dict_metadata["model.embed.weight"] = BytesStorageMetadata()
        return pickle.dumps(md)
    if kind == "path-outside":  # a tensor read from a file outside the checkpoint
        md = real_metadata(step)
        index = next(iter(md.storage_data))
        md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="../../../../etc/passwd")
        return pickle.dumps(md)
    if kind == "class-mutation":  # BUILD on a class: sets Metadata.version for the whole process
        return (b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n"
                b"N}\x8c\x07version\x8c\x05pwned\x73\x86b.")
    if kind == "function-mutation":  # BUILD on torch.serialization._get_layout: poisons its layout cache
        return (b"\x80\x04ctorch.serialization\n_get_layout\n"
                b"}\x8c\x05cache}\x8c\x0dtorch.strided\x8c\x05pwned\x73\x73b.")
    raise ValueError(kind)


RUNS_CODE = ("os.system", "exec", "hidden-in-real-metadata")
PAYLOADS = (*RUNS_CODE, "bytes-item", "path-outside", "class-mutation", "function-mutation")


def tamper(run: Path, tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """A copy of the run whose newest checkpoint's .metadata is ``kind``, COMMIT recomputed; (run, marker)."""
    marker = tmp_path / "pwned"
    bad = copy_run(run, tmp_path / "bad-run")
    data = payload(kind, step_dir(bad), marker)
    (step_dir(bad) / ".metadata").write_bytes(data)
    recommit(step_dir(bad))
    if kind in RUNS_CODE:  # the payload is live: plain pickle runs it
        pickle.loads(data)
        assert marker.exists()
        marker.unlink()
    return bad, marker


def assert_refused(exc_info_or_err: str, kind: str) -> None:
    text = str(exc_info_or_err)
    assert ".metadata" in text and "not a checkpoint zaya wrote" in text and "maliciously" in text, text


@pytest.mark.parametrize("kind", PAYLOADS)
def test_a_crafted_metadata_is_refused_by_every_loader_and_runs_nothing(tmp_path, capsys, run, kind):
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.serialization import _get_layout

    from zaya.checkpoint.parts import ModelState
    from zaya.checkpoint.store import CheckpointStore
    from zaya.config import CheckpointConfig, model_config_from_dict
    from zaya.dist.runtime import Runtime
    from zaya.model import ZayaForCausalLM

    bad, marker = tamper(run, tmp_path, kind)
    layouts_before = dict(_get_layout.cache)

    # Train resume: the store verifies (it passes: the checksums were recomputed), then refuses to load it.
    store = CheckpointStore(bad / "checkpoints", CheckpointConfig(ram_tier=False, ram_dir=str(tmp_path / "shm")),
                            Runtime(), log=lambda s: None)
    chosen = store.select("auto")
    assert chosen == step_dir(bad)
    meta = json.loads((chosen / "meta.json").read_text())
    model = ZayaForCausalLM(model_config_from_dict(meta["model_config"]))
    with pytest.raises(CheckpointError) as err:
        store.load(chosen, {"model": ModelState(model)})
    assert_refused(err.value, kind)

    # Inference, in the library and through the CLI (generate, export).
    with pytest.raises(CheckpointError) as err:
        load_for_inference(bad)
    assert_refused(err.value, kind)
    with pytest.raises(CheckpointError):
        zaya.load_pretrained(step_dir(bad))
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(bad), "--prompt", "JULIET:", "--max-new-tokens", "2"]) == 5
    assert_refused(one_line_error(capsys), kind)
    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(bad), "--to", str(out)]) == 5
    assert_refused(one_line_error(capsys), kind)
    assert not out.exists()

    assert not marker.exists()
    assert "version" not in vars(Metadata) or vars(Metadata)["version"] is None  # the class is untouched
    assert dict(_get_layout.cache) == layouts_before and "pwned" not in map(str, _get_layout.cache.values())


def test_zaya_generate_in_a_subprocess_refuses_a_crafted_metadata(tmp_path, run):
    bad, marker = tamper(run, tmp_path, "os.system")
    done = subprocess.run([sys.executable, "-m", "zaya", "generate", "--checkpoint", str(bad), "--prompt", "JULIET:",
                           "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 5, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert_refused(done.stderr, "os.system")
    assert not marker.exists()


def test_the_planner_refuses_a_bytes_item_without_unpickling_it(tmp_path):
    """Defence in depth: were a bytes item ever planned, its pickle is refused, never torch.load-ed."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from zaya.checkpoint.reader import TensorsOnlyPlanner

    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save(Call(os.system, f"touch {marker}"), buffer)
    buffer.seek(0)
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("model.x"), [0], MetadataIndex("model.x"), [0], [0])
    with pytest.raises(CheckpointError, match="non-tensor item 'model.x' is refused"):
        TensorsOnlyPlanner().load_bytes(item, buffer)
    assert not marker.exists()


# -------------------------------------------------------------------------------------- inference fallback
def test_inference_falls_back_to_the_previous_checkpoint_and_moves_nothing(tmp_path, capsys, run):
    bad = copy_run(run, tmp_path / "run")
    victim = max(step_dir(bad).glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x08
    victim.write_bytes(bytes(data))
    before = sorted(p.name for p in (bad / "checkpoints").iterdir())

    model, _, directory = load_for_inference(bad)
    assert directory == step_dir(bad, 1)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {step_dir(bad)}" in err and victim.name in err and "fails its checksum" in err
    assert sorted(p.name for p in (bad / "checkpoints").iterdir()) == before  # nothing moved aside
    reference, _, _ = load_for_inference(step_dir(run, 1))
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name

    # The CLI too (given the checkpoints directory itself), the warning on stderr.
    assert main(["generate", "--checkpoint", str(bad / "checkpoints"), "--prompt", "JULIET:",
                 "--max-new-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("JULIET:") and "skipping checkpoint" in captured.err
    assert str(step_dir(bad, 1)) in captured.err

    # Named directly, the corrupt checkpoint is refused (never swapped), pointing at the good one.
    assert main(["export", "--checkpoint", str(step_dir(bad)), "--to", str(tmp_path / "out")]) == 5
    err = one_line_error(capsys)
    assert "fails its checksum" in err and str(step_dir(bad, 1)) in err


def test_training_resume_skips_a_corrupt_checkpoint_it_cannot_move_aside(tmp_path, run, monkeypatch):
    """On a run directory it cannot change, the store leaves the failed checkpoint in place and says so."""
    from zaya.checkpoint.store import CheckpointStore
    from zaya.config import CheckpointConfig
    from zaya.dist.runtime import Runtime

    bad = copy_run(run, tmp_path / "run")
    (step_dir(bad) / "meta.json").write_text((step_dir(bad) / "meta.json").read_text().replace('"step"', '"stap"'))

    def read_only(self, path, why="corrupt"):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(CheckpointStore, "_move_aside", read_only)
    logs: list[str] = []
    store = CheckpointStore(bad / "checkpoints", CheckpointConfig(ram_tier=False, ram_dir=str(tmp_path / "shm")),
                            Runtime(), log=logs.append)
    assert store.select("auto") == step_dir(bad, 1)
    assert any("meta.json fails its checksum" in line and "left in place (Permission denied)" in line
               for line in logs), logs
    assert step_dir(bad).is_dir()


def test_a_training_checkpoint_with_nan_weights_is_refused_for_inference(tmp_path, run):
    from zaya.checkpoint.parts import ModelState
    from zaya.checkpoint.store import CheckpointStore
    from zaya.config import CheckpointConfig
    from zaya.dist.runtime import Runtime

    model, _, directory = load_for_inference(run)
    with torch.no_grad():
        model.embed.weight[3].fill_(float("nan"))
    meta = json.loads((directory / "meta.json").read_text())
    store = CheckpointStore(tmp_path / "run" / "checkpoints", CheckpointConfig(ram_tier=False,
                                                                              ram_dir=str(tmp_path / "shm")),
                            Runtime(), log=lambda s: None)
    saved = store.save(5, {"model": ModelState(model)}, {"model_config": meta["model_config"], "tokens": 0},
                       blocking=True)
    assert saved.ok
    with pytest.raises(CheckpointError, match=r"tensor 'model\.embed\.weight' holds 64 non-finite values"):
        load_for_inference(saved.path)


# ---------------------------------------------------------------------------------------------------- exports
def copy_export(exports, fmt: str, tmp_path: Path, manifest: bool = True) -> Path:
    out = Path(shutil.copytree(exports[fmt], tmp_path / fmt))
    if not manifest:
        (out / MANIFEST).unlink()
    return out


def cli_refuses(capsys, directory: Path, *needles: str) -> None:
    """`zaya generate` and `zaya export` on ``directory``: exit 5 with one line naming the file and the fix."""
    capsys.readouterr()
    out = directory.parent / f"{directory.name}-exported"
    for argv in (["generate", "--checkpoint", str(directory), "--prompt", "JULIET:", "--max-new-tokens", "2"],
                 ["export", "--checkpoint", str(directory), "--to", str(out)]):
        assert main(argv) == 5
        err = one_line_error(capsys)
        for needle in needles:
            assert needle in err, err
    assert not out.exists()


def test_exports_carry_checksums_and_normal_modes(exports):
    for directory in exports.values():
        lines = (directory / MANIFEST).read_text().splitlines()
        listed = {line.split("  ", 1)[1] for line in lines}
        assert listed == {p.name for p in directory.iterdir()} - {MANIFEST}
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755 & ~current_umask()
        for f in directory.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644 & ~current_umask(), f


def current_umask() -> int:
    from zaya.fsutil import umask

    return umask()


def test_export_modes_follow_the_umask(tmp_path, run):
    old = os.umask(0o027)
    try:
        out = export(run, tmp_path / "sub" / "hf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o640}


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_a_flipped_bit_in_an_export_is_found_by_its_checksum(tmp_path, capsys, exports, fmt):
    out = copy_export(exports, fmt, tmp_path)
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40  # the top exponent bit of the last float: finite (~1e36), loads silently without the manifest
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors fails its checksum"):
        zaya.load_pretrained(out)
    cli_refuses(capsys, out, str(weights), "fails its checksum", "export it again", MANIFEST)


def test_an_unlisted_file_in_an_export_is_refused(tmp_path, capsys, exports):
    out = copy_export(exports, "hf", tmp_path)
    (out / "generation_config.json").write_text('{"do_sample": false}')  # read by the loader, never exported
    cli_refuses(capsys, out, "generation_config.json is not listed", MANIFEST)


def test_a_malformed_manifest_is_refused(tmp_path, capsys, exports):
    out = copy_export(exports, "hf", tmp_path)
    (out / MANIFEST).write_text(f"{'0' * 64}  ../../etc/passwd\n")
    cli_refuses(capsys, out, f"{MANIFEST}, line 1")


def rewrite_header(path: Path, change) -> None:
    """Rewrite a safetensors header in place (the data bytes unchanged): ``change(header)`` edits the dict."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


def rewrite_tensors(path: Path, change) -> None:
    """Load a safetensors file, ``change(tensors)``, save it back (a valid file with other contents)."""
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


EMBED = "model.embed_tokens.weight"


def _int32(header):
    header[EMBED]["dtype"] = "I32"


def _lying_offsets(header):
    name = next(k for k in header if k not in ("__metadata__", EMBED))
    header[name]["data_offsets"] = header[EMBED]["data_offsets"]


def _transposed(header):
    header[EMBED]["shape"] = header[EMBED]["shape"][::-1]


MALFORMED = {
    "0-byte": (lambda p: p.write_bytes(b""), "not a readable safetensors file"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-1000]), "not a readable safetensors file"),
    "corrupt-header": (lambda p: p.write_bytes(p.read_bytes()[:8] + b"{\x00garbage" + p.read_bytes()[18:]),
                       "not a readable safetensors file"),
    "lying-offsets": (lambda p: rewrite_header(p, _lying_offsets), "not a readable safetensors file"),
    "int32-tensor": (lambda p: rewrite_header(p, _int32), f"tensor '{EMBED}' is int32"),
    "wrong-shape": (lambda p: rewrite_header(p, _transposed), f"tensor '{EMBED}' has shape"),
    "missing-tensor": (lambda p: rewrite_tensors(p, lambda t: t.pop("model.norm.weight")),
                       "'model.norm.weight' is missing"),
    "extra-tensor": (lambda p: rewrite_tensors(p, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)})),
                     "unexpected tensor 'model.layers.0.extra.weight'"),
    "all-nan-embedding": (lambda p: rewrite_tensors(p, lambda t: t[EMBED].fill_(float("nan"))),
                          f"tensor '{EMBED}' holds"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_safetensors_is_a_checkpoint_error_naming_the_file(tmp_path, capsys, exports, case):
    """A Hugging Face directory from elsewhere (no manifest): the structural checks alone find each case; with the
    manifest recomputed over the damage (whoever wrote it), the same checks still refuse it."""
    damage, needle = MALFORMED[case]
    out = copy_export(exports, "hf", tmp_path, manifest=False)
    weights = out / "model.safetensors"
    damage(weights)
    with pytest.raises(CheckpointError) as err:
        zaya.load_pretrained(out)
    assert str(weights) in str(err.value) or str(out) in str(err.value)
    cli_refuses(capsys, out, needle, "model.safetensors")
    write_checksums(out)
    with pytest.raises(CheckpointError, match=needle.replace("'", ".").replace("(", ".").replace(")", ".")):
        zaya.load_pretrained(out)


def test_a_zaya_export_with_nan_weights_is_refused(tmp_path, capsys, exports):
    out = copy_export(exports, "safetensors", tmp_path)
    weights = out / "model.safetensors"
    rewrite_tensors(weights, lambda t: t["blocks.1.moe.experts.down_proj"][0, 0, 0].fill_(float("inf")))
    write_checksums(out)  # rewritten on purpose, manifest and all: the values are still refused
    cli_refuses(capsys, out, "tensor 'blocks.1.moe.experts.down_proj' holds 1 non-finite", str(weights))


@pytest.fixture(scope="module")
def sharded(exports, tmp_path_factory) -> Path:
    from zaya.model.hf import save_hf

    model = zaya.load_pretrained(exports["hf"])
    return save_hf(model, tmp_path_factory.mktemp("sharded") / "hf", max_shard_bytes=200_000)


def test_a_sharded_index_that_lies_is_refused(tmp_path, capsys, sharded):
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert zaya.load_pretrained(sharded) is not None

    missing = Path(shutil.copytree(sharded, tmp_path / "missing"))
    (missing / shards[1].name).unlink()
    (missing / MANIFEST).unlink()
    cli_refuses(capsys, missing, f"lists {shards[1].name}, which is missing", "model.safetensors.index.json")

    moved = Path(shutil.copytree(sharded, tmp_path / "moved"))
    index = moved / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    name = next(k for k, v in weight_map["weight_map"].items() if v == shards[0].name)
    weight_map["weight_map"][name] = shards[1].name
    index.write_text(json.dumps(weight_map))
    write_checksums(moved)
    cli_refuses(capsys, moved, f"holds tensor '{name}'", f"says is in {shards[1].name}")

    outside = Path(shutil.copytree(sharded, tmp_path / "outside"))
    index = outside / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    weight_map["weight_map"][name] = "../../elsewhere.safetensors"
    index.write_text(json.dumps(weight_map))
    (outside / MANIFEST).unlink()
    cli_refuses(capsys, outside, "weight_map is not a mapping")


def test_corrupt_json_files_are_checkpoint_errors(tmp_path, capsys, exports):
    hf = copy_export(exports, "hf", tmp_path, manifest=False)
    (hf / "config.json").write_text('{"model_type": "zaya",')
    cli_refuses(capsys, hf, "config.json is not valid JSON")
    own = copy_export(exports, "safetensors", tmp_path, manifest=False)
    (own / "zaya.json").write_text("[1, 2]")
    cli_refuses(capsys, own, "zaya.json holds a JSON list, not an object")


@pytest.mark.parametrize("key, value, code, needle", [
    ("num_hidden_layers", 10**9, 5, "the config says 1000000000 layers, the weights hold 2"),  # never built
    ("rope_parameters", "default", 2, "rope_parameters = 'default' is not supported"),
    ("rms_norm_eps", "tiny", 2, "rms_norm_eps = 'tiny' is not a number"),
    ("layer_types", 7, 2, "layer_types = 7 is not supported"),
    ("eos_token_id", [], 2, "eos_token_id = [] is not supported"),
    ("tie_word_embeddings", "no", 2, "tie_word_embeddings = 'no' is not supported"),
])
def test_config_values_of_the_wrong_kind_are_named(tmp_path, capsys, exports, key, value, code, needle):
    hf = copy_export(exports, "hf", tmp_path, manifest=False)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, key: value}))
    assert main(["generate", "--checkpoint", str(hf), "--prompt", "JULIET:", "--max-new-tokens", "2"]) == code
    assert needle in one_line_error(capsys)


@pytest.fixture
def alarm():
    """Fail a test that blocks (a read of a FIFO) after 30 s instead of hanging the suite."""
    def ring(signum, frame):
        raise TimeoutError("blocked for 30 s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_a_fifo_where_a_file_belongs_never_blocks_a_load(tmp_path, capsys, run, exports, alarm):
    out = copy_export(exports, "safetensors", tmp_path)
    (out / "model.safetensors").unlink()
    os.mkfifo(out / "model.safetensors")
    cli_refuses(capsys, out, "model.safetensors, listed in SHA256SUMS, is missing or not a regular file")
    (out / MANIFEST).unlink()
    cli_refuses(capsys, out, "model.safetensors is missing or not a regular file")

    # A run whose newest COMMIT is a FIFO, or lists no .metadata: incomplete, so the previous checkpoint is loaded.
    bad = copy_run(run, tmp_path / "run")
    (step_dir(bad) / "COMMIT").unlink()
    os.mkfifo(step_dir(bad) / "COMMIT")
    assert load_for_inference(bad)[2] == step_dir(bad, 1)
    commit = json.loads((step_dir(bad, 1) / "COMMIT").read_text())
    del commit["files"][".metadata"]
    (step_dir(bad, 1) / "COMMIT").write_text(json.dumps(commit))
    with pytest.raises(CheckpointError, match="COMMIT does not list .metadata"):
        load_for_inference(step_dir(bad, 1))
