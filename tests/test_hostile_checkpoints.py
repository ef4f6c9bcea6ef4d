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

The session's micro run (2 steps, a checkpoint at each) is the run; its two exports are made once for the module."""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import os
import pickle
import re
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
from conftest import MICRO_RUN_STEPS as STEPS
from dist_helpers import run_ranks
from zaya.checkpoint.commit import FileRecord, checksum_file, read_commit, write_commit
from zaya.checkpoint.consolidate import load_for_inference
from zaya.checkpoint.export import export
from zaya.cli import main
from zaya.core.errors import CheckpointError
from zaya.model.checksums import MANIFEST, write_checksums



# ------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def run(micro_run) -> Path:
    return micro_run


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
    from zaya.distributed.runtime import Runtime
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


@pytest.mark.slow
def test_zaya_generate_in_a_subprocess_refuses_a_crafted_metadata(tmp_path, run):
    """test_a_crafted_metadata_is_refused_by_every_loader_and_runs_nothing[os.system] covers the same refusal of
    `zaya generate` (exit 5, one line, nothing run) through main in the test process; this one in a fresh
    interpreter (30 s of start-up on 2 busy cores)."""
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
    from zaya.distributed.runtime import Runtime

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
    from zaya.distributed.runtime import Runtime

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
    from zaya.core.fsutil import umask

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
    # A shard index beside a one-file export: the loader reads it, the export never wrote it.
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        weight_map = {name: "model.safetensors" for name in f.keys()}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cli_refuses(capsys, out, "model.safetensors.index.json is not listed", MANIFEST)


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
    ("num_hidden_layers", 3, 5, "the config says 3 layers, the weights hold 2"),  # never built
    ("num_hidden_layers", 10**9, 2, "num_layers = 1000000000"),
    ("eos_token_id", 10**9, 2, "eos_token_id = 1000000000"),  # inside the vocabulary, or generate failed (exit 70)
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


# ------------------------------------------------------------- .metadata bombs: linear time, nothing shared changed
def in_child(fn, timeout: float = 30.0):
    """Run ``fn()`` in a forked child: ("ok", its result's repr) or ("error", message), ("timeout", seconds) when it
    runs past ``timeout`` (a hash that takes 2**90 steps never returns to the interpreter), ("crash", signal). For
    pure-Python work only: torch's thread pools do not survive a fork (``loaded_in_fresh_process`` for a load)."""
    import select
    import time

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        try:
            message = json.dumps(["ok", repr(fn())[:2000]])
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            message = json.dumps(["error", f"{type(exc).__name__}: {exc}"[:4000]])
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    start = time.monotonic()
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - start
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return "crash", os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return tuple(json.loads(b"".join(chunks)))


def copy_step(run: Path, dst: Path) -> Path:
    return Path(shutil.copytree(step_dir(run), dst))


def commit_all(step: Path) -> None:
    """A COMMIT listing every regular file of ``step`` with its size and crc32 (what whoever wrote it can do)."""
    files = {f.name: FileRecord(f.stat().st_size, "crc32", checksum_file(f, "crc32")) for f in step.iterdir()
             if f.is_file() and not f.is_symlink() and f.name != "COMMIT"}
    write_commit(step, int(step.name.split("-")[1]) if "-" in step.name else 0, files)


def with_planner_data(step: Path, instructions: bytes) -> bytes:
    """A real metadata whose planner_data is whatever the pickle ``instructions`` build (spliced in as raw ops)."""
    md = real_metadata(step)
    md.planner_data = "@@PLACEHOLDER@@"
    data = pickle.dumps(md, protocol=2)
    placeholder = b"X" + struct.pack("<I", 15) + b"@@PLACEHOLDER@@"
    assert data.count(placeholder) == 1
    return data.replace(placeholder, instructions)


def dag(levels: int) -> bytes:
    """t_k = (t_{k-1}, t_{k-1}) through the memo: ~5 bytes a level, hashing t_n takes 2**n steps."""
    return b")" + b"q\xffh\xff\x86" * levels


def colliding_sizes(count: int) -> list[tuple[int, int]]:
    """``count`` pairs (a, b) of ints in [0, 2**61 - 1) whose tuples share one hash (CPython's xxHash-based tuple
    hash solved for the second lane), as crafted torch.Size offsets of MetadataIndex keys would."""
    m, p1, p2, p5 = 2**64, 11400714785074694791, 14029467366897019727, 2870177450012600261

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (64 - r))) % m

    def lane1(a: int) -> int:
        return rotl((p5 + a * p2) % m, 31) * p1 % m

    goal = rotl((lane1(0) + 12345 * p2) % m, 31) * p1 % m
    want = rotl(goal * pow(p1, -1, m) % m, 64 - 31)
    pairs, a = [], 1
    while len(pairs) < count:
        b = (want - lane1(a)) * pow(p2, -1, m) % m
        if b < 2**61 - 2:
            pairs.append((a, b))
        a += 1
    return pairs


def colliding_locations(step: Path) -> bytes:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = real_metadata(step)
    index, info = next(iter(md.storage_data.items()))
    pairs = colliding_sizes(500)
    assert len({hash(torch.Size(p)) for p in pairs}) == 1
    md.storage_data.update({MetadataIndex(index.fqn, p): info for p in pairs})
    return pickle.dumps(md)


BOMBS = {  # kind: (the .metadata, what the refusal says)
    "hash-bomb-key": (lambda s: with_planner_data(s, b"}" + dag(90) + b"K\x01s"), "as a dictionary key"),
    "deep-tuple-key": (lambda s: with_planner_data(s, b"})" + b"\x85" * 500_000 + b"K\x01s"),
                       "as a dictionary key"),
    "set-of-hash-bomb": (lambda s: with_planner_data(s, b"\x8f(" + dag(80) + b"\x90"), "EMPTY_SET"),
    "frozenset-of-hash-bomb": (lambda s: with_planner_data(s, b"(" + dag(80) + b"\x91"), "FROZENSET"),
    "colliding-locations": (colliding_locations, "share one hash"),
    "colliding-int-keys": (lambda s: with_planner_data(s, b"}(" + b"".join(
        b"\x8a\x10" + (i * (2**61 - 1)).to_bytes(16, "little", signed=True) + b"K\x01" for i in range(1, 3000))
        + b"u"), "ints are within"),
    "deep-list": (lambda s: with_planner_data(s, b"]" * 300_000 + b"a" * 299_999), "planner data"),
    "memo-text-index": (lambda s: with_planner_data(s, b"N" + b"p2305843009213693951\n" * 3), "PUT"),
    "trailing-call": (lambda s: (s / ".metadata").read_bytes() + pickle.dumps(Call(os.system, "true")),
                      "follow the end of its pickle"),
}


@pytest.mark.parametrize("kind", BOMBS)
def test_a_metadata_bomb_is_refused_in_linear_time(tmp_path, run, kind):
    """Each of these hung every loader at 100% CPU (a hash of 2**90 steps), crashed it (C recursion in a tuple's
    hash) or took minutes (colliding keys): read in a forked child, each is refused within seconds."""
    from zaya.checkpoint.reader import read_metadata

    make, needle = BOMBS[kind]
    step = copy_step(run, tmp_path / "step-00000002")
    (step / ".metadata").write_bytes(make(step))
    recommit(step)
    outcome = in_child(lambda: read_metadata(step), timeout=60)
    assert outcome[0] == "error", outcome
    assert outcome[1].startswith("CheckpointError: ") and str(step / ".metadata") in outcome[1], outcome
    assert needle in outcome[1] and "possibly maliciously" in outcome[1], outcome


STATE_SETTERS = {  # BUILD on a member of the process-wide enum (reached by calling its class), as the audit made them
    "enum-value": (b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n(K\x00tR"
                   b"}\x8c\x07_value_K\x07sb0N."),
    "enum-value-other-member": (b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n(K\x01tR"
                                b"}\x8c\x07_value_Kcsb0N."),
    "enum-name-slotstate": (b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n(K\x00tR"
                            b"N}\x8c\x06_name_\x8c\x05PWNEDs\x86b0N."),
    "built-twice": None,  # a real metadata, then its Metadata filled again (version = 'pwned')
}


@pytest.mark.parametrize("kind", STATE_SETTERS)
def test_a_refused_metadata_changes_nothing_shared(tmp_path, run, kind):
    """State is set only on an instance this unpickling created itself, once: the file is refused and the enum, used
    by every DCP save of the process, is as it was (a later save and load work)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from zaya.checkpoint.reader import load_dcp, read_metadata

    before = [(m, m._name_, m._value_, dict(vars(m))) for m in _MEM_FORMAT_ENCODING]
    step = copy_step(run, tmp_path / "step-00000002")
    data = STATE_SETTERS[kind]
    if data is None:  # protocol 2 memoizes the class as 0, the Metadata as 1: BINGET 1, BUILD, POP before STOP
        data = pickle.dumps(real_metadata(step), protocol=2)[:-1] + b"h\x01}\x8c\x07version\x8c\x05pwnedsb0."
        assert pickle.loads(data).version == "pwned"
    (step / ".metadata").write_bytes(data)
    recommit(step)
    with pytest.raises(CheckpointError, match="possibly maliciously"):
        read_metadata(step)
    assert [(m, m._name_, m._value_, dict(vars(m))) for m in _MEM_FORMAT_ENCODING] == before
    fresh = tmp_path / "fresh"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(fresh), no_dist=True)
    (fresh / "meta.json").write_text("{}")
    commit_all(fresh)
    loaded = {"w": torch.zeros(4)}
    load_dcp(fresh, loaded)
    assert loaded["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ------------------------------------------------------------------------- data files: listed, regular, inside
def first_entry_at(step: Path, **changes) -> bytes:
    """The real metadata with its first storage entry (the embedding's data) changed."""
    md = real_metadata(step)
    index = next(iter(md.storage_data))
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], **changes)
    return pickle.dumps(md)


def item_archive(data_pkl: bytes) -> bytes:
    """A torch.save archive of a tensor whose data.pkl is ``data_pkl`` (what one item of a .distcp file is)."""
    import zipfile

    buffer = io.BytesIO()
    torch.save(torch.ones(64), buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name in source.namelist():
            archive.writestr(name, data_pkl if name.endswith("data.pkl") else source.read(name))
    return out.getvalue()


def item_in_new_file(step: Path, data_pkl: bytes) -> bytes:
    """model.final_norm.weight's data pointed at a new, listed data file holding ``item_archive(data_pkl)``."""
    archive = item_archive(data_pkl)
    (step / "__1_0.distcp").write_bytes(archive)
    md = real_metadata(step)
    index = next(i for i in md.storage_data if i.fqn == "model.final_norm.weight")
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="__1_0.distcp", offset=0,
                                                 length=len(archive))
    return pickle.dumps(md)


def _link(step: Path, target: str) -> bytes:
    (step / "evil.distcp").symlink_to(target)
    return first_entry_at(step, relative_path="evil.distcp")


def _fifo(step: Path) -> bytes:
    os.mkfifo(step.parent / "fifo")
    (step / "fifo.distcp").symlink_to(step.parent / "fifo")
    return first_entry_at(step, relative_path="fifo.distcp")


DATA_FILES = {  # kind: (the .metadata, given the step directory; what the refusal says)
    "unlisted-link-to-passwd": (lambda s: _link(s, "/etc/passwd"), "'evil.distcp', which is not a file its COMMIT"),
    "unlisted-link-to-fifo": (_fifo, "'fifo.distcp', which is not a file its COMMIT lists"),
    "past-the-end": (lambda s: first_entry_at(s, length=10**9), "bytes 0+1000000000 of __0_0.distcp"),
    "item-hash-bomb": (lambda s: item_in_new_file(s, b"\x80\x02}" + dag(90) + b"K\x01s."),
                       "__1_0.distcp: the item at byte 0 is refused: its pickle uses the instruction EMPTY_DICT"),
    "item-deep-tuple-key": (lambda s: item_in_new_file(s, b"\x80\x02})" + b"\x85" * 500_000 + b"K\x01s."),
                            "its pickle has 500,008 bytes"),
}


def _load_for_inference(rank: int, world: int, path: str) -> str:
    load_for_inference(path)
    return "loaded"


def loaded_in_fresh_process(path: Path, timeout: float = 60) -> str:
    """``load_for_inference(path)`` in a fresh process (forked from the rank server, whose torch has run nothing:
    its thread pools are new): its one-line outcome ("loaded", the error, or why it gave none when it hung or
    crashed)."""
    (result,) = run_ranks(_load_for_inference, 1, str(path), timeout_s=timeout)
    return "loaded" if result.error is None else result.error.split("\nTraceback (most recent call last):")[0]


@pytest.mark.parametrize("kind", DATA_FILES)
def test_a_load_reads_only_regular_files_its_commit_lists(tmp_path, run, kind):
    """A .metadata (COMMIT recomputed) pointing a tensor at a link to /etc/passwd or to a FIFO (the FIFO hung every
    loader), past a file's end, or at an item whose pickle would hang or crash torch.load, is refused naming the
    file. Read where a regression fails instead of hanging or crashing the suite: the metadata in a forked child, an
    item (read by torch after the model is built) in a fresh process."""
    from zaya.checkpoint.reader import read_metadata

    make, needle = DATA_FILES[kind]
    step = copy_step(run, tmp_path / "run" / "step-00000002")
    (step / ".metadata").write_bytes(make(step))
    commit_all(step)
    if kind.startswith("item-"):
        outcome = loaded_in_fresh_process(step)
    else:
        outcome = ": ".join(in_child(lambda: read_metadata(step) and None))
        assert outcome.startswith("error: "), outcome
        outcome = outcome.removeprefix("error: ")
    assert outcome.startswith("CheckpointError: ") and needle in outcome, outcome
    assert "possibly maliciously" in outcome, outcome


@pytest.mark.parametrize("listed", ["/etc/passwd", "../step-00000001/meta.json", "link.distcp"])
def test_commit_lists_only_plain_regular_files_of_the_checkpoint(tmp_path, capsys, run, listed):
    """A COMMIT naming a file outside the checkpoint (whose size and checksum were checked, then whose data could be
    read), or a link, makes the checkpoint damaged: named, and the previous one loaded."""
    bad = copy_run(run, tmp_path / "run")
    commit = json.loads((step_dir(bad) / "COMMIT").read_text())
    target = (step_dir(bad) / listed).resolve() if not listed.startswith("/") else Path(listed)
    if listed == "link.distcp":
        (step_dir(bad) / listed).symlink_to(step_dir(bad) / "__0_0.distcp")
        target = step_dir(bad) / "__0_0.distcp"
    commit["files"][listed] = {"size": target.stat().st_size, "crc32": checksum_file(target, "crc32")}
    (step_dir(bad) / "COMMIT").write_text(json.dumps(commit))
    assert load_for_inference(bad)[2] == step_dir(bad, 1)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {step_dir(bad)}" in err, err
    assert ("not a regular file" if listed == "link.distcp" else "which is not the name of a file") in err, err
    with pytest.raises(CheckpointError, match=str(step_dir(bad))):
        load_for_inference(step_dir(bad))


# ------------------------------------------------------------------------------ chunks that tile their tensor
NORM = "model.final_norm.weight"


def _chunks(change):
    def make(step: Path) -> bytes:
        md = real_metadata(step)
        change(md)
        return pickle.dumps(md)
    return make


def _short_embedding(md):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    entry = md.state_dict_metadata["model.embed.weight"]
    entry.chunks[0] = ChunkStorageMetadata(entry.chunks[0].offsets, torch.Size([entry.size[0] - 1, entry.size[1]]))


def _halves(md):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    for key, entry in md.state_dict_metadata.items():
        if key.startswith("model.") and len(entry.size) == 2:
            entry.chunks[0] = ChunkStorageMetadata(entry.chunks[0].offsets,
                                                   torch.Size([entry.size[0] // 2, entry.size[1]]))


def _overlapping(md):
    """Two chunks of 256 rows at rows 0 and 255: the volume is the tensor's, row 255 twice and row 511 never."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    key = "model.embed.weight"
    entry = md.state_dict_metadata[key]
    rows, cols = entry.size
    entry.chunks[:] = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([rows // 2, cols])),
                       ChunkStorageMetadata(torch.Size([rows // 2 - 1, 0]), torch.Size([rows // 2, cols]))]
    md.storage_data[MetadataIndex(key, [rows // 2 - 1, 0])] = md.storage_data[MetadataIndex(key, [0, 0])]


TILINGS = {
    "norm-without-chunks": (_chunks(lambda md: md.state_dict_metadata[NORM].chunks.clear()),
                            f"'{NORM}' cover 0 elements of its 64"),
    "embedding-one-row-short": (_chunks(_short_embedding), "'model.embed.weight' cover 32,704 elements of its 32,768"),
    "half-of-every-matrix": (_chunks(_halves), "cover 16,384 elements of its 32,768"),
    "no-chunks-at-all": (_chunks(lambda md: [e.chunks.clear() for e in md.state_dict_metadata.values()]),
                         "cover 0 elements"),
    "overlapping-chunks": (_chunks(_overlapping), "'model.embed.weight' overlap at [255, 0]"),
}


@pytest.mark.parametrize("kind", TILINGS)
def test_chunks_that_do_not_tile_their_tensor_are_refused(tmp_path, run, kind):
    """A tensor whose chunks leave elements out was loaded with uninitialised memory in it (exit 0, output varying
    from run to run), or refused as holding 'non-finite values'; now refused naming the tensor and the file."""
    make, needle = TILINGS[kind]
    step = copy_step(run, tmp_path / "run" / "step-00000002")
    (step / ".metadata").write_bytes(make(step))
    recommit(step)
    with pytest.raises(CheckpointError) as err:
        load_for_inference(step)
    assert str(step / ".metadata") in str(err.value) and needle in str(err.value), err.value


@pytest.mark.parametrize("size, chunks", [
    ((8,), [((0,), (4,)), ((4,), (4,))]),  # FSDP's shards along dim 0
    ((5, 6), [((0, 0), (3, 6)), ((3, 0), (2, 6)), ((5, 0), (0, 6)), ((5, 0), (0, 6))]),  # uneven, empty ones
    ((4, 6), [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]),  # a 2-D mesh's grid
    ((), [((), ())]),  # a scalar
    ((0, 3), []),  # an empty tensor needs no chunk
])
def test_the_tiling_check_accepts_the_layouts_dcp_writes(size, chunks):
    from zaya.checkpoint.metadata_check import tiling_problem

    assert tiling_problem(size, chunks) is None
    assert "overlap" in tiling_problem((4,), [((0,), (2,)), ((1,), (2,)), ((3,), (0,))])


def test_a_tiling_that_is_no_grid_is_refused_without_examining_its_cells():
    """A staircase of 80 chunks (each row split at another column) tiles its tensor, but its edges make 40 x 41
    cells: not a layout DCP writes, refused before a cell is examined (there could be millions)."""
    from zaya.checkpoint.metadata_check import tiling_problem

    bricks = [brick for row in range(40) for brick in (((row, 0), (1, row + 1)), ((row, row + 1), (1, 40 - row)))]
    assert sum(s[0] * s[1] for _, s in bricks) == 40 * 41
    assert "do not form a grid" in tiling_problem((40, 41), bricks)


# ------------------------------------------------------------------------------------- a damaged newest checkpoint
def test_a_newest_checkpoint_whose_sizes_differ_from_its_commit_is_named_not_silently_skipped(tmp_path, capsys, run):
    """A checkpoint with a COMMIT marker is complete or damaged, never in progress: inference used to fall back to an
    older step without a word when a file had another size than COMMIT records; training now moves it aside and says
    so. A step directory without COMMIT (a save that died) is still skipped without a word."""
    from zaya.checkpoint.store import CheckpointStore
    from zaya.config import CheckpointConfig
    from zaya.distributed.runtime import Runtime

    bad = copy_run(run, tmp_path / "run")
    (step_dir(bad) / ".metadata").write_bytes((step_dir(bad) / ".metadata").read_bytes() + b"\0")
    shutil.copytree(step_dir(bad, 1), step_dir(bad, 3))
    (step_dir(bad, 3) / "COMMIT").unlink()
    assert load_for_inference(bad)[2] == step_dir(bad, 1)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {step_dir(bad)}" in err and ".metadata has " in err and "COMMIT says" in err, err
    assert "step-00000003" not in err

    logs: list[str] = []
    store = CheckpointStore(bad / "checkpoints", CheckpointConfig(ram_tier=False, ram_dir=str(tmp_path / "shm")),
                            Runtime(), log=logs.append)
    assert store.select("auto") == step_dir(bad, 1)
    assert any(f"{step_dir(bad)} failed verification" in line and "COMMIT says" in line for line in logs), logs
    assert (bad / "checkpoints" / "corrupt-step-00000002").is_dir() and step_dir(bad, 3).is_dir()


# -------------------------------------------------------------------- JSON nested 100,000 deep, config values
DEEP_JSON = "[" * 100_000 + "]" * 100_000


def _extras_config(directory: Path) -> Path:
    extras = directory / "zaya_extras.safetensors"
    tensors = load_file(str(extras))
    save_file(tensors, str(extras), metadata={"format": "pt", "zaya_model_config": DEEP_JSON})
    return extras


NESTED = {  # kind: (export format, or "training"; write the deep JSON, returning the file; needle)
    "zaya.json": ("safetensors", lambda d: d / "zaya.json", "zaya.json is not valid JSON"),
    "config.json": ("hf", lambda d: d / "config.json", "config.json is not valid JSON"),
    "shard-index": ("hf", lambda d: d / "model.safetensors.index.json", "index.json is not valid JSON"),
    "extras-model-config": ("hf", _extras_config, "its zaya_model_config is not JSON"),
    "meta.json": ("training", lambda d: d / "meta.json", "meta.json cannot be read"),
    "COMMIT": ("training", lambda d: d / "COMMIT", "COMMIT is not valid JSON"),
}


@pytest.mark.parametrize("kind", NESTED)
def test_json_nested_100k_deep_is_a_checkpoint_error_naming_the_file(tmp_path, capsys, run, exports, kind):
    """The json module raises RecursionError on it, which escaped as a traceback (exit 70) from every reader."""
    fmt, where, needle = NESTED[kind]
    directory = copy_step(run, tmp_path / "step-00000002") if fmt == "training" else \
        copy_export(exports, fmt, tmp_path, manifest=False)
    target = where(directory)
    if target.suffix != ".safetensors":
        target.write_text(DEEP_JSON)
    if kind == "meta.json":
        recommit(directory)
    assert main(["generate", "--checkpoint", str(directory), "--prompt", "JULIET:", "--max-new-tokens", "2"]) == 5
    err = one_line_error(capsys)
    assert needle in err and str(directory) in err and "nested too deeply" in err, err


def test_a_training_resume_refuses_a_meta_json_nested_100k_deep(tmp_path, run):
    """meta.json read on resume (its checksum recomputed, so it passes verification): a CheckpointError."""
    from zaya.checkpoint.parts import ModelState
    from zaya.checkpoint.store import CheckpointStore
    from zaya.config import CheckpointConfig
    from zaya.distributed.runtime import Runtime

    bad = copy_run(run, tmp_path / "run")
    (step_dir(bad) / "meta.json").write_text(DEEP_JSON)
    recommit(step_dir(bad))
    store = CheckpointStore(bad / "checkpoints", CheckpointConfig(ram_dir=str(tmp_path / "shm")), Runtime(),
                            log=lambda s: None)
    assert store.select("auto") == step_dir(bad)
    with pytest.raises(CheckpointError, match="meta.json cannot be read .JSON nested too deeply"):
        store.load(step_dir(bad), {"model": ModelState(torch.nn.Linear(2, 2))})


def test_a_training_checkpoints_model_config_is_validated(tmp_path, capsys, run):
    """meta.json's model config goes through ModelConfig's checks: an eos id outside the vocabulary made generate
    fail on its own input (exit 70)."""
    step = copy_step(run, tmp_path / "step-00000002")
    meta = json.loads((step / "meta.json").read_text())
    meta["model_config"]["eos_token_id"] = 10**9
    (step / "meta.json").write_text(json.dumps(meta))
    recommit(step)
    assert main(["generate", "--checkpoint", str(step), "--prompt", "JULIET:", "--max-new-tokens", "2"]) == 2
    assert "eos_token_id = 1000000000" in one_line_error(capsys)


# ------------------------------------------------------------------------------------------------- SHA256SUMS
def _manifest_line(name: str):
    def add(directory: Path) -> None:
        with open(directory / MANIFEST, "a") as fh:
            fh.write(f"{'0' * 64}  {name}\n")
    return add


def _manifest_fifo(directory: Path) -> None:
    (directory / MANIFEST).unlink()
    os.mkfifo(directory / MANIFEST)


def _manifest_huge(directory: Path) -> None:
    with open(directory / MANIFEST, "a") as fh:
        fh.write(f"{'0' * 64}  {'x' * (17 << 20)}\n")


MANIFESTS = {
    "name-past-name-max": (_manifest_line("x" * 256), "SHA256SUMS, line {last}: not '<sha256>  <file name>'"),
    "fifo": (_manifest_fifo, "SHA256SUMS is not a regular file"),  # was taken for no manifest: loaded unchecked
    "50-mb-line": (_manifest_huge, "more than any export's manifest"),  # exit 70: File name too long
}


@pytest.mark.parametrize("kind", MANIFESTS)
def test_a_manifest_naming_other_than_files_of_the_export_is_refused(tmp_path, capsys, exports, kind, alarm):
    change, needle = MANIFESTS[kind]
    out = copy_export(exports, "hf", tmp_path)
    needle = needle.format(last=len((out / MANIFEST).read_text().splitlines()) + 1)
    change(out)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        zaya.load_pretrained(out)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(out), "--prompt", "JULIET:", "--max-new-tokens", "2"]) == 5
    assert needle in one_line_error(capsys)
