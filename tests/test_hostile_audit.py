"""What the second independent audit of hostile inputs found (issue 32), each case refused clearly and quickly.

The audit (347 new inputs against 26a5d9f) left 4 hangs, 5 tracebacks and 8 silently wrong results; these tests
hold each fix: a padded ``.metadata`` and a gzip bomb refused in seconds, a tensor item of another dtype or naming
something else than a tensor refused, a tokenizer whose normalizer holds a megabyte refused at load; a heartbeat
that is a FIFO or a link to /dev/zero, a config nested 20,000 deep, an allocation the machine cannot hold and an
export to a full disk each a clear error, not a hang or a traceback; an export's tokenizer and every eos id checked.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import pickle
import time
from pathlib import Path

import pytest
import torch

from test_hostile_checkpoints import commit_all, copy_export, copy_step, exports, in_child, real_metadata, recommit  # noqa: F401
from zaya.checkpoint.errors import CheckpointError
from zaya.checkpoint.metadata_pickle import item_pickle_problem
from zaya.cli import main
from zaya.model.checksums import write_checksums


def test_a_padded_metadata_is_refused_before_it_is_unpickled(tmp_path, run):
    """300 MB of MARK/POP_MARK pairs took minutes at the unpickler's ~1 MB/s; a metadata larger than the data it
    describes (and than 4 MiB) is refused from its size."""
    from zaya.checkpoint.reader import read_metadata

    step = copy_step(run, tmp_path / "step-00000002")
    (step / ".metadata").write_bytes(b"\x80\x02" + b"(1" * (3 << 20) + b"N.")
    recommit(step)
    start = time.monotonic()
    outcome = in_child(lambda: read_metadata(step), timeout=60)
    assert outcome[0] == "error" and "more than the data files it describes" in outcome[1], outcome
    assert time.monotonic() - start < 30


def _item(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _data_pkl(archive: bytes) -> bytes:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def test_an_item_pickle_is_a_tensor_of_the_declared_dtype():
    """The storage class a tensor item names says its dtype; only tensor-building names pass (torch's own refusal
    of ``os.system`` advised retrying with weights_only=False)."""
    f32 = _data_pkl(_item(torch.ones(4)))
    assert item_pickle_problem(f32) is None and item_pickle_problem(f32, torch.float32) is None
    assert "holds int8 values where the metadata declares float32" in \
        item_pickle_problem(_data_pkl(_item(torch.ones(4, dtype=torch.int8))), torch.float32)
    assert item_pickle_problem(_data_pkl(_item(torch.ones(4, dtype=torch.bfloat16))), torch.bfloat16) is None
    evil = f32.replace(b"torch._utils\n_rebuild_tensor_v2", b"posix\nsystem\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
                       b"\x00\x00\x00\x00\x00\x00\x00\x00")
    assert "asks for" in item_pickle_problem(evil) or "damaged" in item_pickle_problem(evil)
    assert "asks for 'posix system'" in item_pickle_problem(b"\x80\x02cposix\nsystem\nq\x00.")


def test_an_item_of_another_dtype_is_refused_at_load(tmp_path, run):
    """A .distcp item replaced by an int8 tensor of the right shape (COMMIT recomputed) was cast into the float32
    weight by every loader, exit 0; now the load names the file and the dtypes."""
    from zaya.checkpoint.consolidate import load_for_inference

    step = copy_step(run, tmp_path / "run" / "step-00000002")
    md = real_metadata(step)
    index = next(i for i in md.storage_data if i.fqn == "model.final_norm.weight")
    archive = _item(torch.zeros(md.state_dict_metadata[index.fqn].size, dtype=torch.int8))
    (step / "__1_0.distcp").write_bytes(archive)
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="__1_0.distcp", offset=0,
                                                 length=len(archive))
    (step / ".metadata").write_bytes(pickle.dumps(md))
    commit_all(step)
    with pytest.raises(CheckpointError, match="holds int8 values where the metadata declares float32"):
        load_for_inference(step)


def test_a_tokenizer_whose_pipeline_holds_a_megabyte_is_refused_at_load(tmp_path, run):
    """A normalizer prepending 1 MB to every text made ``zaya generate`` run for minutes."""
    from zaya.data.tokenizer import Tokenizer, TokenizerError

    spec = json.loads((run / "tokenizer.json").read_text())
    Tokenizer.from_file(run / "tokenizer.json")
    for key, part in (("normalizer", {"type": "Prepend", "prepend": "x" * (1 << 20)}),
                      ("decoder", {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "a"},
                                                                     "content": "y" * 5000}]})):
        bad = tmp_path / f"{key}.json"
        bad.write_text(json.dumps({**spec, key: part}))
        with pytest.raises(TokenizerError, match=rf"{bad}: its {key}\S* holds a text of"):
            Tokenizer.from_file(bad)


def test_a_gzip_bomb_is_refused_once_it_expands_past_100x(tmp_path):
    """1 MB of gzip expanding to 1 GB of NULs kept ``data prepare`` busy for a quarter of an hour; text (which
    compresses 3-5x) is unaffected."""
    from zaya.data.sources import InputError, InputStats, iter_pieces

    bomb = tmp_path / "bomb.txt.gz"
    with gzip.open(bomb, "wb") as fh:
        for _ in range(100):
            fh.write(bytes(1 << 20))
    with pytest.raises(InputError, match=r"bomb.txt.gz: expands to more than 100 times"):
        for _ in iter_pieces([bomb], InputStats()):
            pass
    text = tmp_path / "text.jsonl.gz"
    with gzip.open(text, "wb") as fh:
        for i in range(5000):
            fh.write(json.dumps({"text": f"line {i} of a plain document"}).encode() + b"\n")
    assert sum(1 for _ in iter_pieces([text], InputStats())) == 5000


@pytest.fixture(scope="module")
def run(micro_run) -> Path:
    return micro_run


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_heartbeat_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """A FIFO blocked `zaya chaos inject` forever; a link to /dev/zero read until memory ran out (MemoryError)."""
    import os

    from zaya.aegis.heartbeat import heartbeat_dir, read_heartbeats

    directory = heartbeat_dir(tmp_path)
    directory.mkdir(parents=True)
    path = directory / "rank-00000.json"
    os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
    problems: dict = {}
    outcome = in_child(lambda: (read_heartbeats(tmp_path, problems), problems), timeout=20)
    assert outcome[0] == "ok" and "not a regular file" in outcome[1], outcome


def test_a_config_nested_too_deep_is_a_config_error(tmp_path, capsys):
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 20_000 + "1" + "]" * 20_000 + "\n")
    assert main(["train", "--config", str(deep)]) == 2
    assert f"{deep}: arrays or tables nested too deep" in capsys.readouterr().err


def test_an_allocation_the_machine_cannot_hold_is_named_not_a_bug(monkeypatch, capsys):
    """torch's CPU allocator raises a RuntimeError (model.num_experts=10**6 asked for 49 GB): exit 2 saying what to
    shrink, where it was exit 70 'this is a bug'."""
    import zaya.cli as cli

    def fails(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 49152000000 bytes. Error code 12")

    monkeypatch.setattr(cli, "_cmd_train", fails)
    assert main(["train", "--config", "configs/tiny.toml"]) == 2
    err = capsys.readouterr().err
    assert "out of memory (can't allocate memory: you tried to allocate 49152000000 bytes)" in err, err
    assert "Traceback" not in err
    monkeypatch.setattr(cli, "_cmd_train", lambda args: (_ for _ in ()).throw(RuntimeError("a real bug")))
    assert main(["train", "--config", "configs/tiny.toml"]) == 70


def test_an_export_to_a_full_disk_exits_5_naming_the_directory(tmp_path, run, capsys):
    """A file-size limit (as a full disk) made safetensors raise 'I/O error: File too large (os error 27)': exit 70
    with a traceback; now exit 5 naming the destination, and nothing left there. Through main in this process (a
    `zaya export` subprocess cost 35 s of start-up on 2 busy cores), the limit set only around the call."""
    from proc_helpers import file_size_limit

    out = tmp_path / "out"
    with file_size_limit(300_000):
        code = main(["export", "--checkpoint", str(run), "--to", str(out)])
    err = capsys.readouterr().err
    assert code == 5, err
    assert f"exporting to {out}" in err and "File too large" in err and "Traceback" not in err
    assert not out.exists()


def test_an_exports_tokenizer_must_be_listed_in_its_manifest(tmp_path, capsys, exports):
    """tokenizer.json rewritten and dropped from SHA256SUMS loaded without a word."""
    hf = copy_export(exports, "hf", tmp_path)
    manifest = hf / "SHA256SUMS"
    manifest.write_text("".join(line + "\n" for line in manifest.read_text().splitlines()
                                if not line.endswith("tokenizer.json")))
    assert main(["generate", "--checkpoint", str(hf), "--prompt", "JULIET:", "--max-new-tokens", "2"]) == 5
    assert f"{hf / 'tokenizer.json'} is not listed in {manifest}" in capsys.readouterr().err


def test_every_eos_id_of_a_hf_config_is_in_the_vocabulary(tmp_path, capsys, exports):
    hf = copy_export(exports, "hf", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], 10**6]}))
    write_checksums(hf)
    assert main(["generate", "--checkpoint", str(hf), "--prompt", "JULIET:", "--max-new-tokens", "2"]) == 2
    assert "eos_token_id = [" in capsys.readouterr().err
