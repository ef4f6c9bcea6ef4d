"""`zaya data prepare` / `zaya data inspect`: round trips, determinism, bundle roll-over, and every error path.

The reference for a round trip is the input text itself: decoding a document's ids (without its trailing eos) must
give the document back exactly, in input order. Inputs are tiny files written into tmp_path; one test prepares the
built-in corpus.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from data_helpers import EOS, tiny_tokenizer
from proc_helpers import ended_process
from zaya.cli import main
from zaya.data import prepare as prepare_mod
from zaya.data import sources
from zaya.data.bundle import HEADER, MANIFEST, Bundle, BundleWriter, DatasetError, PreparedDataset
from zaya.data.loader import check_vocabulary
from zaya.data.prepare import PrepareOptions, prepare
from zaya.data.sources import InputError, InputStats, clean_play_markdown, expand_inputs, iter_pieces
from zaya.data.tokenizer import SpecialIds, Tokenizer

UNICODE = "Naïve café — “quotes” ✓ 日本語 🎭 Ελληνικά 𝔘𝔫𝔦"


# --- helpers ---------------------------------------------------------------------------------------------------------
def run_prepare(tmp_path: Path, inputs, out: str = "out", **kw):
    kw.setdefault("vocab_size", 320)
    kw.setdefault("val_fraction", 0.0)
    logs: list[str] = []
    opts = PrepareOptions(inputs=[str(i) for i in inputs], out=str(tmp_path / out), **kw)
    result = prepare(opts, log=logs.append)
    return result, logs


def decoded(out: Path, split: str) -> list[str]:
    """Each document of a split decoded without its eos; checks every document ends with (exactly one) eos."""
    ds = PreparedDataset(out)
    tok = ds.tokenizer()
    docs = []
    for ids in ds.split(split).documents():
        assert ids[-1] == ds.eos_id
        assert ds.eos_id not in ids[:-1].tolist()
        docs.append(tok.decode(ids[:-1]))
    return docs


def write_jsonl(path: Path, records, field: str = "text", gz: bool = False) -> Path:
    lines = "".join(json.dumps({field: r, "id": i}, ensure_ascii=False) + "\n" for i, r in enumerate(records))
    if gz:
        path.write_bytes(gzip.compress(lines.encode("utf-8")))
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def mixed_inputs(root: Path) -> tuple[list[Path], list[str]]:
    """.txt, .md, .jsonl (field "body"), .txt.gz and a directory; returns the inputs and the expected documents."""
    root.mkdir()
    a = "Hello, world.\nA line with trailing spaces   \n\n\tTabbed line\n"
    b = f"# Título\n\n{UNICODE}\r\nWindows line ending\r\nno final newline"
    c = ["first record ü", "second\nrecord with a newline 𝔘𝔫𝔦\n", "  leading spaces and a tab\t"]
    d = "gzipped text: Ελληνικά\n\n\n"
    (root / "a.txt").write_text(a, encoding="utf-8", newline="")
    (root / "b.md").write_text(b, encoding="utf-8", newline="")
    write_jsonl(root / "c.jsonl", c, field="body")
    (root / "d.txt.gz").write_bytes(gzip.compress(d.encode("utf-8")))
    tree = root / "tree"
    (tree / "sub").mkdir(parents=True)
    m = ["from a gzipped jsonl", "日本語のテキスト"]
    write_jsonl(tree / "m.jsonl.gz", m, field="body", gz=True)
    (tree / "sub" / "s.md").write_text("in a subdirectory: ö\n", encoding="utf-8")
    (tree / "z.txt").write_text("zeta, last in sorted order", encoding="utf-8")
    (tree / "notes.csv").write_text("ignored,by,directory,walk\n")  # unsupported files in a directory are skipped
    inputs = [root / "a.txt", root / "b.md", root / "c.jsonl", root / "d.txt.gz", tree]
    expected = [a, b, *c, d, *m, "in a subdirectory: ö\n", "zeta, last in sorted order"]
    return inputs, expected


# --- round trips -----------------------------------------------------------------------------------------------------
def test_round_trip_every_input_kind_in_input_order(tmp_path):
    inputs, expected = mixed_inputs(tmp_path / "in")
    result, _ = run_prepare(tmp_path, inputs, text_field="body")
    out = tmp_path / "out"
    assert decoded(out, "train") == expected
    assert decoded(out, "val") == []
    m = json.loads((out / MANIFEST).read_text())
    assert m == result.manifest
    assert m["splits"]["train"]["documents"] == len(expected)
    assert m["stats"]["documents"] == len(expected)
    assert m["stats"]["files"] == 7  # a, b, c, d and the three supported files of the tree
    assert m["stats"]["decode_errors"] == m["stats"]["bad_lines"] == 0
    assert m["tokenizer"]["eos_id"] == 2 and m["tokenizer"]["eos_token"] == "<|eos|>"
    # Every stored token is a real id of the tokenizer.
    ds = PreparedDataset(out)
    ids = np.concatenate([np.asarray(b.tokens) for b in ds.split("train").bundles])
    assert int(ids.max()) < m["tokenizer"]["vocab_size"]


def test_val_split_partitions_the_documents(tmp_path):
    rng = random.Random(0)
    texts = [f"document {i}: " + " ".join(rng.choice(["to", "be", "or", "not", "ça", "日本"]) for _ in range(8))
             for i in range(60)]
    inputs = [write_jsonl(tmp_path / "docs.jsonl", texts)]
    result, _ = run_prepare(tmp_path, inputs, val_fraction=0.3, seed=1)
    train, val = decoded(tmp_path / "out", "train"), decoded(tmp_path / "out", "val")
    assert sorted(train + val) == sorted(texts)  # texts are distinct, so this is exact set equality
    assert len(val) == result.manifest["splits"]["val"]["documents"] > 0
    assert len(train) == result.manifest["splits"]["train"]["documents"] > 0
    # Each split keeps the input order.
    assert train == [t for t in texts if t in set(train)]
    assert val == [t for t in texts if t in set(val)]
    # The split is a function of the seed: the same seed holds out the same documents, another seed others.
    run_prepare(tmp_path, inputs, out="again", val_fraction=0.3, seed=1)
    run_prepare(tmp_path, inputs, out="other", val_fraction=0.3, seed=2)
    assert decoded(tmp_path / "again", "val") == val
    assert decoded(tmp_path / "other", "val") != val


def test_document_larger_than_a_piece_is_one_document(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "PIECE_BYTES", 64)
    rng = random.Random(0)
    lines = [" ".join(rng.choice(["word", "naïve", "🎭", "日本語"]) for _ in range(rng.randint(1, 12)))
             for _ in range(40)]
    big = "\n".join(lines) + "\n" + "日本語" * 100 + "é" * 33  # a long tail with no newline: cut between chars
    record = "x" * 50 + UNICODE * 10
    small = "short one\n"
    (tmp_path / "big.txt").write_text(big, encoding="utf-8")
    (tmp_path / "small.txt").write_text(small, encoding="utf-8")
    write_jsonl(tmp_path / "r.jsonl", [record])
    inputs = [tmp_path / "big.txt", tmp_path / "r.jsonl", tmp_path / "small.txt"]
    # The patch takes effect: the big inputs really arrive in several pieces.
    pieces = list(iter_pieces(expand_inputs([str(p) for p in inputs]), InputStats()))
    assert len(pieces) > 10 and [p.end_of_document for p in pieces].count(True) == 3
    run_prepare(tmp_path, inputs)
    assert decoded(tmp_path / "out", "train") == [big, record, small]
    # With a validation split, a document's pieces all go to the split of its first piece.
    run_prepare(tmp_path, inputs, out="split", val_fraction=0.5, seed=0)
    train, val = decoded(tmp_path / "split", "train"), decoded(tmp_path / "split", "val")
    assert sorted(train + val) == sorted([big, record, small]) and train and val


def is_subsequence(part: list[str], whole: list[str]) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


def test_builtin_shakespeare_one_document_per_scene(shakespeare_dataset):
    """The session's prepared built-in corpus (tests/conftest.py): every scene once, each split in corpus order."""
    from zaya.data.corpus import corpus_files

    expected = [doc for f in corpus_files() for doc in clean_play_markdown(f.read_text(encoding="utf-8"))]
    assert len(expected) > 700
    manifest = json.loads((shakespeare_dataset / MANIFEST).read_text())
    assert manifest["stats"]["files"] == 38 and manifest["stats"]["documents"] == len(expected)
    assert manifest["dtype"] == "uint16"
    train, val = decoded(shakespeare_dataset, "train"), decoded(shakespeare_dataset, "val")
    assert sorted(train + val) == sorted(expected)
    assert is_subsequence(train, expected) and is_subsequence(val, expected)
    assert 0 < len(val) < len(train)


# --- determinism and bundles -----------------------------------------------------------------------------------------
def many_docs_inputs(root: Path) -> list[Path]:
    root.mkdir()
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "δέλτα", "epsilon", "日本", "🎭", "zeta\n"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(120)]
    write_jsonl(root / "a.jsonl", texts[:80])
    for i, t in enumerate(texts[80:]):
        (root / f"t{i:02d}.txt").write_text(t, encoding="utf-8")
    return [root]


def test_workers_1_and_2_write_identical_bundles(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "BATCH_BYTES", 300)  # many small batches in flight, so ordering matters
    inputs = many_docs_inputs(tmp_path / "in")
    opts = dict(val_fraction=0.2, bundle_mb=0.0005, seed=3)
    one, _ = run_prepare(tmp_path, inputs, out="w1", workers=1, **opts)
    two, _ = run_prepare(tmp_path, inputs, out="w2", workers=2, **opts)
    files1 = sorted(p.name for p in (tmp_path / "w1").iterdir())
    files2 = sorted(p.name for p in (tmp_path / "w2").iterdir())
    assert files1 == files2
    assert sum(name.endswith(".zb") for name in files1) >= 4
    for name in files1:
        if name != MANIFEST:  # the manifest records the time and the options (workers), so it differs
            assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    assert one.manifest["splits"] == two.manifest["splits"]
    assert one.manifest["tokenizer"] == two.manifest["tokenizer"]


def test_bundles_roll_over_at_bundle_mb_and_headers_match_manifest(tmp_path):
    inputs = many_docs_inputs(tmp_path / "in")
    limit = 400  # bytes
    result, _ = run_prepare(tmp_path, inputs, val_fraction=0.2, bundle_mb=limit / 1e6, seed=0)
    out = tmp_path / "out"
    ds = PreparedDataset(out, verify=True)
    for name, split in result.manifest["splits"].items():
        entries = split["bundles"]
        assert len(entries) >= 2, name
        assert [e["file"] for e in entries] == [f"{name}-{i:05d}.zb" for i in range(len(entries))]
        assert split["tokens"] == sum(e["tokens"] for e in entries)
        assert split["documents"] == sum(e["documents"] for e in entries)
        for k, (entry, bundle) in enumerate(zip(entries, ds.split(name).bundles)):
            raw = (out / entry["file"]).read_bytes()
            magic, version, width, tokens, documents, tok_off, idx_off, mask_off = HEADER.unpack(raw[:HEADER.size])
            assert (magic, version, width, tok_off, mask_off) == (b"ZAYABNDL", 1, 2, 64, 0)  # no mask: version 1
            assert (tokens, documents) == (entry["tokens"], entry["documents"])
            assert (bundle.num_tokens, bundle.num_documents) == (tokens, documents)
            assert len(raw) == entry["bytes"] == idx_off + 8 * (documents + 1)
            assert idx_off % 8 == 0
            index = np.frombuffer(raw[idx_off:], "<u8")
            assert index[0] == 0 and index[-1] == tokens and np.all(np.diff(index) >= 1)
            size = HEADER.size + 2 * tokens
            if k < len(entries) - 1:
                # Rolled over at the first document end that reached the limit, not before, not later.
                last_doc = int(index[-1] - index[-2])
                assert size >= limit and size - 2 * last_doc < limit
    # Splitting into bundles loses nothing: the documents are the same as with one big bundle.
    run_prepare(tmp_path, inputs, out="one", val_fraction=0.2, seed=0)
    for name in ("train", "val"):
        assert len(PreparedDataset(tmp_path / "one").split(name).bundles) == 1
        assert decoded(tmp_path / "one", name) == decoded(out, name)


def test_dtype_uint16_up_to_65536_ids_else_uint32():
    class FakeBackend:  # the three methods Tokenizer reads, for vocabularies too big to build quickly
        def __init__(self, n):
            self.vocab = {f"t{i}": i for i in range(n)}

        def get_vocab_size(self, with_added_tokens=True):
            return len(self.vocab)

        def get_vocab(self, with_added_tokens=True):
            return self.vocab

        def to_str(self, pretty=False):
            return json.dumps({"n": len(self.vocab)})

    special = SpecialIds(0, 1, 2)
    assert Tokenizer(FakeBackend(320), special).dtype == np.uint16
    assert Tokenizer(FakeBackend(65536), special).dtype == np.uint16  # max id 65535
    assert Tokenizer(FakeBackend(65537), special).dtype == np.uint32
    big = Tokenizer(FakeBackend(65536), special)
    big.backend.vocab["<added>"] = 70000  # an added token above the base vocabulary decides the dtype
    assert Tokenizer(big.backend, special).dtype == np.uint32
    assert Tokenizer(FakeBackend(65537), special).padded_vocab_size == 65600


@pytest.mark.parametrize("dtype,width", [(np.uint16, 2), (np.uint32, 4)])
def test_bundle_writer_round_trip(tmp_path, dtype, width):
    top = np.iinfo(dtype).max
    docs = [np.array([5, 6, 7]), np.array([top, 0, top - 1]), np.array([], dtype=np.int64), np.array([9])]
    if width == 4:
        docs.append(np.array([70000, 2**32 - 1]))
    path = tmp_path / "b.zb"
    writer = BundleWriter(path, dtype)
    for doc in docs:
        half = len(doc) // 2
        writer.write(doc[:half], False)  # a document may arrive in several writes
        writer.write(doc[half:], False)
        writer.write(np.array([EOS]), True)
    entry = writer.close()
    assert not list(tmp_path.glob("*.index-spool"))
    bundle = Bundle(path, expect=entry)
    assert bundle.dtype == np.dtype(dtype).newbyteorder("<") and bundle.dtype.itemsize == width
    assert bundle.num_documents == len(docs) == entry["documents"]
    assert bundle.num_tokens == sum(len(d) + 1 for d in docs) == entry["tokens"]
    for i, doc in enumerate(docs):
        assert bundle.document(i).tolist() == doc.tolist() + [EOS]
    assert HEADER.unpack(path.read_bytes()[:64])[2] == width


def test_prepare_with_an_existing_tokenizer(tmp_path):
    inputs, expected = mixed_inputs(tmp_path / "in")
    first, _ = run_prepare(tmp_path, inputs, text_field="body")
    tokenizer = tmp_path / "out" / "tokenizer.json"
    second, logs = run_prepare(tmp_path, inputs, out="reuse", text_field="body", tokenizer=str(tokenizer))
    assert not any("training" in line for line in logs)
    assert decoded(tmp_path / "reuse", "train") == expected
    assert (tmp_path / "reuse" / "train-00000.zb").read_bytes() == (tmp_path / "out" / "train-00000.zb").read_bytes()
    for key in ("sha256", "vocab_size", "eos_id", "bos_id", "pad_id", "eos_token"):
        assert second.manifest["tokenizer"][key] == first.manifest["tokenizer"][key], key
    from zaya.data.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match=r"eos token '</s>' \(given.*is not in the vocabulary"):
        run_prepare(tmp_path, inputs, out="bad-eos", tokenizer=str(tokenizer), eos_token="</s>")
    with pytest.raises(TokenizerError, match="nope.json: tokenizer file not found"):
        run_prepare(tmp_path, inputs, out="bad-eos", tokenizer=str(tmp_path / "nope.json"))


def test_prepare_picks_uint16(tmp_path):
    (tmp_path / "a.txt").write_text("some text to tokenize\n")
    result, _ = run_prepare(tmp_path, [tmp_path / "a.txt"])
    assert result.manifest["dtype"] == "uint16"
    assert PreparedDataset(tmp_path / "out").split("train").bundles[0].dtype.itemsize == 2


# --- bad input -------------------------------------------------------------------------------------------------------
def test_empty_input_is_an_error_naming_the_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(InputError, match="empty.txt"):
        run_prepare(tmp_path, [empty])
    assert not (tmp_path / "out").exists()
    # Bytes but no document text (every JSON Lines record empty), with an existing tokenizer: the same.
    tok = tiny_tokenizer()
    tok.save(tmp_path / "tok.json")
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(InputError, match="blank.jsonl"):
        run_prepare(tmp_path, [blank], tokenizer=str(tmp_path / "tok.json"))
    assert not (tmp_path / "out").exists()


def test_missing_path_and_unsupported_extension(tmp_path):
    with pytest.raises(InputError, match="nope.txt: no such file"):
        run_prepare(tmp_path, [tmp_path / "nope.txt"])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(InputError, match=r"data\.csv: unsupported file type"):
        run_prepare(tmp_path, [tmp_path / "data.csv"])
    (tmp_path / "bad.txt.gz").write_bytes(b"plain text, not gzip\n")
    with pytest.raises(InputError, match=r"bad\.txt\.gz: cannot read"):
        run_prepare(tmp_path, [tmp_path / "bad.txt.gz"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="holds no .txt"):
        run_prepare(tmp_path, [tmp_path / "d"])
    assert not (tmp_path / "out").exists()


def test_undecodable_bytes_replaced_and_counted(tmp_path):
    raw = "ok ü\n".encode() + b"\xff\xfe bad\n" + "tail é".encode() + b"\xc3"  # 2 bad bytes + a cut char
    (tmp_path / "bad.txt").write_bytes(raw)
    result, logs = run_prepare(tmp_path, [tmp_path / "bad.txt"])
    expected = raw.decode("utf-8", errors="replace")
    assert decoded(tmp_path / "out", "train") == [expected]
    assert result.manifest["stats"]["decode_errors"] == expected.count("\ufffd") == 3
    assert any("invalid UTF-8" in line for line in logs)


def test_undecodable_bytes_strict_names_file_and_offset(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "PIECE_BYTES", 16)  # the offset must count across pieces
    raw = b"hello world\n" * 5 + b"abc\xffdef\n"
    (tmp_path / "bad.txt").write_bytes(raw)
    offset = raw.index(b"\xff")
    assert offset == 63
    with pytest.raises(InputError) as err:
        run_prepare(tmp_path, [tmp_path / "bad.txt"], strict=True)
    assert f"bad.txt: invalid UTF-8 at byte {offset} " in str(err.value)
    assert not (tmp_path / "out").exists()
    # In a JSON Lines file the error names the line.
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "b\xffd"}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:2: invalid UTF-8"):
        run_prepare(tmp_path, [tmp_path / "bad.jsonl"], strict=True)


def test_bad_json_lines_skipped_and_counted_or_strict_error(tmp_path):
    lines = ['{"text": "good one"}', "{not json", '["a list"]', '{"other": 1}', '{"text": 5}', "",
             '{"text": "good two"}']
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result, logs = run_prepare(tmp_path, [path])
    assert decoded(tmp_path / "out", "train") == ["good one", "good two"]
    assert result.manifest["stats"]["bad_lines"] == 4  # the blank line is not a record, so not counted
    assert any("skipped" in line for line in logs)
    with pytest.raises(InputError, match=r"mixed\.jsonl:2: not valid JSON"):
        run_prepare(tmp_path, [path], out="strict", strict=True)
    path.write_text('{"text": "good"}\n{"body": "x"}\n')
    with pytest.raises(InputError, match=r"mixed\.jsonl:2: no string field 'text'.*--text-field"):
        run_prepare(tmp_path, [path], out="strict", strict=True)
    assert not (tmp_path / "strict").exists()


def test_existing_out_needs_force(tmp_path):
    (tmp_path / "a.txt").write_text("first version\n")
    run_prepare(tmp_path, [tmp_path / "a.txt"])
    (tmp_path / "a.txt").write_text("second version\n")
    with pytest.raises(FileExistsError, match=r"out already exists.*--force"):
        run_prepare(tmp_path, [tmp_path / "a.txt"])
    assert decoded(tmp_path / "out", "train") == ["first version\n"]
    run_prepare(tmp_path, [tmp_path / "a.txt"], force=True)
    assert decoded(tmp_path / "out", "train") == ["second version\n"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out"]  # no leftover old/temp directories


def small_dataset(tmp_path: Path, **kw) -> Path:
    inputs = many_docs_inputs(tmp_path / "in")
    run_prepare(tmp_path, inputs, val_fraction=0.2, bundle_mb=0.0004, **kw)
    return tmp_path / "out"


def test_truncated_bundle_detected_on_open(tmp_path):
    out = small_dataset(tmp_path)
    victim = out / "train-00001.zb"
    data = victim.read_bytes()
    victim.write_bytes(data[:-5])
    with pytest.raises(DatasetError, match=r"train-00001\.zb.*truncated"):
        PreparedDataset(out)
    with pytest.raises(DatasetError, match=r"train-00001\.zb.*truncated"):
        Bundle(victim)  # without a manifest the header gives it away
    victim.write_bytes(data[:40])
    with pytest.raises(DatasetError, match=r"train-00001\.zb: shorter than a bundle header"):
        Bundle(victim)
    victim.unlink()
    with pytest.raises(DatasetError, match=r"train-00001\.zb: bundle file missing"):
        PreparedDataset(out)


def test_flipped_byte_detected_by_verify_and_cli(tmp_path, capsys):
    out = small_dataset(tmp_path)
    assert len(PreparedDataset(out).verify()) == 1 + len(list(out.glob("*.zb")))
    victim = out / "val-00001.zb"
    data = bytearray(victim.read_bytes())
    data[HEADER.size + 3] ^= 0x01  # inside the token array: size and header still agree
    victim.write_bytes(bytes(data))
    PreparedDataset(out)  # opening does not read every byte
    with pytest.raises(DatasetError, match=r"val-00001\.zb: sha256 differs"):
        PreparedDataset(out).verify()
    with pytest.raises(DatasetError, match=r"val-00001\.zb"):
        PreparedDataset(out, verify=True)
    capsys.readouterr()
    assert main(["data", "inspect", str(out), "--verify"]) == 3  # a data error
    err = capsys.readouterr().err
    assert err.startswith("zaya: error: ") and "val-00001.zb" in err and "sha256" in err


def test_unknown_manifest_version_and_missing_manifest(tmp_path):
    out = small_dataset(tmp_path)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["format_version"] = 99
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"manifest\.json: dataset format_version 99; this zaya reads version 1"):
        PreparedDataset(out)
    (out / MANIFEST).unlink()
    with pytest.raises(DatasetError, match="no manifest.json"):
        PreparedDataset(out)
    with pytest.raises(DatasetError, match="no such dataset directory"):
        PreparedDataset(tmp_path / "elsewhere")


def test_check_vocabulary(tmp_path):
    out = small_dataset(tmp_path)
    ds = PreparedDataset(out)
    need = ds.manifest["tokenizer"]["vocab_size"]
    padded = ds.manifest["tokenizer"]["padded_vocab_size"]
    assert need <= 320 and padded == 320
    check_vocabulary(ds, padded, model_eos_id=ds.eos_id)
    check_vocabulary(ds, need)
    check_vocabulary(ds, need + 256)  # the documented slack for a padded embedding
    for wrong in (need - 1, need + 257, 1024):
        with pytest.raises(DatasetError) as err:
            check_vocabulary(ds, wrong)
        assert f"{need:,} ids" in str(err.value) and f"model.vocab_size is {wrong:,}" in str(err.value)
        assert f"model.vocab_size = {padded}" in str(err.value)
    with pytest.raises(DatasetError, match=r"eos id 2 .*model\.eos_token_id is 7"):
        check_vocabulary(ds, padded, model_eos_id=7)


def test_seq_len_longer_than_any_bundle(tmp_path):
    from zaya.data.loader import DataLoader, SequenceSource, Stage

    out = small_dataset(tmp_path)
    ds = PreparedDataset(out)
    longest = max(b.num_tokens for b in ds.split("train").bundles)
    with pytest.warns(UserWarning, match="never used"):  # most tokens are dropped at this seq_len, and it says so
        source = SequenceSource(ds.split("train"), longest - 1)
    # Exactly one window fits in the largest bundle (in each, should several share the largest size).
    assert source.num_sequences == sum(b.num_tokens == longest for b in ds.split("train").bundles)
    with pytest.raises(DatasetError, match=f"seq_len {longest} is longer than any"):
        SequenceSource(ds.split("train"), longest)
    with pytest.raises(DatasetError, match=f"seq_len {longest + 5} is longer"):
        DataLoader({"d": ds}, [Stage("s", longest + 5, 1, {"d": 1.0})], prefetch=0)


# --- interrupted prepare ---------------------------------------------------------------------------------------------
def _fail_after_first(monkeypatch, owner, name):
    original = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("simulated crash")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


@pytest.mark.parametrize("where", ["bundle-close", "encode"])
def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch, where):
    monkeypatch.setattr(prepare_mod, "BATCH_BYTES", 300)
    inputs = many_docs_inputs(tmp_path / "in")
    if where == "bundle-close":
        calls = _fail_after_first(monkeypatch, BundleWriter, "close")
    else:
        calls = _fail_after_first(monkeypatch, prepare_mod, "_encode")
    work = tmp_path / "work"
    work.mkdir()
    before = sorted(p.name for p in work.iterdir())
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare(PrepareOptions(inputs=[str(i) for i in inputs], out=str(work / "ds"), vocab_size=320,
                               bundle_mb=0.0005, val_fraction=0.1), log=lambda m: None)
    assert len(calls) == 2
    assert not (work / "ds").exists()
    assert sorted(p.name for p in work.iterdir()) == before  # no .ds.tmp-* directory left behind
    assert not list(tmp_path.rglob("*.zb")) and not list(tmp_path.rglob("*.index-spool"))


def test_interrupted_prepare_with_force_keeps_the_old_dataset(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "a.jsonl", ["the old text", "more old text"])
    run_prepare(tmp_path, [path])
    old = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    calls = _fail_after_first(monkeypatch, BundleWriter, "close")
    write_jsonl(path, ["the new text", "more new text", "and more"])
    with pytest.raises(RuntimeError, match="simulated crash"):
        # A one-byte bundle limit closes a bundle after every document: the second close fails.
        run_prepare(tmp_path, [path], force=True, bundle_mb=1e-6)
    assert len(calls) == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]


# --- command line ----------------------------------------------------------------------------------------------------
def test_cli_prepare_then_inspect(tmp_path, capsys):
    inputs, expected = mixed_inputs(tmp_path / "in")
    out = tmp_path / "ds"
    argv = ["data", "prepare", "--input", *map(str, inputs[:3]), "--input", *map(str, inputs[3:]), "--out", str(out),
            "--vocab-size", "320", "--val-fraction", "0", "--text-field", "body", "--bundle-mb", "0.0002"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote {out}: ")
    assert decoded(out, "train") == expected
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["options"]["text_field"] == "body" and manifest["options"]["vocab_size"] == 320
    assert len(manifest["splits"]["train"]["bundles"]) > 1

    assert main(["data", "inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    train = info["splits"]["train"]
    assert train["documents"] == len(expected) == manifest["splits"]["train"]["documents"]
    assert train["tokens"] == manifest["splits"]["train"]["tokens"]
    assert train["bundles"] == len(manifest["splits"]["train"]["bundles"])
    assert info["splits"]["val"]["documents"] == 0
    assert sum(row["documents"] for row in train["length_histogram"]) == len(expected)
    ds = PreparedDataset(out)
    lengths = [len(d) for d in ds.split("train").documents()]
    assert train["max_document_tokens"] == max(lengths)
    assert train["mean_document_tokens"] == pytest.approx(np.mean(lengths))
    # The sample is the first document's first 64 tokens, decoded: here all of it, eos included.
    assert info["sample"] == expected[0] + "<|eos|>"
    assert info["verified"] == []
    assert main(["data", "inspect", str(out), "--json", "--sample-tokens", "3"]) == 0
    short = json.loads(capsys.readouterr().out)["sample"]
    assert short and expected[0].startswith(short) and len(short) < len(expected[0])

    assert main(["data", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert str(out) in text and "train" in text and f"{len(expected):,} documents" in text
    assert "verified" not in text
    assert main(["data", "inspect", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    n_files = 1 + len(list(out.glob("*.zb")))
    assert f"verified   {n_files} file(s)" in text


def test_cli_errors_exit_2_or_3(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text\n")
    base = ["data", "prepare", "--input", str(tmp_path / "a.txt"), "--vocab-size", "320"]
    assert main([*base, "--out", str(tmp_path / "ds")]) == 0
    capsys.readouterr()
    cases = [
        ([*base, "--out", str(tmp_path / "ds")], "already exists"),
        (["data", "prepare", "--input", str(tmp_path / "missing.md"), "--out", str(tmp_path / "x")], "missing.md"),
        ([*base, "--out", str(tmp_path / "x"), "--val-fraction", "1.5"], "--val-fraction 1.5"),
        (["data", "prepare", "--input", str(tmp_path / "a.txt"), "--vocab-size", "300", "--out", str(tmp_path / "x")],
         "vocab size 300"),
    ]
    data_errors = [(["data", "inspect", str(tmp_path / "nowhere")], "nowhere: no such dataset directory")]
    for argv, needle in cases + data_errors:
        assert main(argv) == (3 if (argv, needle) in data_errors else 2), argv
        err = capsys.readouterr().err
        last = err.splitlines()[-1]  # prepare may log progress to stderr before failing
        assert last.startswith("zaya: error: ") and needle in last, (argv, err)
        assert "Traceback" not in err
    assert not (tmp_path / "x").exists()


# --- no silent loss: the reason for no text, a killed prepare's folder, a full disk ----------------------------------
@pytest.mark.parametrize("lines,needles", [
    (['{"content": "hello"}', '{"content": "more", "id": 3}', '{"body": "x"}'],
     ["3 JSON Lines record(s) have no string field 'text'", "first at", "in.jsonl:1", "'content' (2)", "'body' (1)",
      "--text-field content"]),
    (['{"id": 3}', '[1, 2]'],
     ["1 JSON Lines record(s) have no string field 'text'", "no string field at all",
      "1 line(s) are not JSON objects (the first: ", "in.jsonl:2: not a JSON object"]),
    (['{"text": ""}', '{"text": ""}'], ["2 document(s) are empty"]),
])
def test_no_text_says_why_and_the_fix(tmp_path, lines, needles):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as err:
        run_prepare(tmp_path, [path])
    message = str(err.value)
    assert message.startswith(f"no text in the inputs ({path})") and "every document was empty" not in message
    for needle in needles:
        assert needle in message, message


def test_a_killed_prepares_folder_is_removed_when_its_owner_has_ended_and_reported_otherwise(tmp_path):
    import os
    import socket

    from zaya.core import procs
    from zaya.data import leftovers

    path = write_jsonl(tmp_path / "a.jsonl", ["some text", "more text"])
    out = tmp_path / "ds[1]"  # glob characters in the name: matched as text
    owners = {"dead": ended_process(), "live": procs.record(),
              "remote": {**procs.record(), "host": socket.gethostname() + "-elsewhere"}, "unrecorded": None}
    for name, owner in owners.items():
        folder = tmp_path / f".ds[1].tmp-{name}"
        (folder / "train-00000.zb").parent.mkdir()
        (folder / "train-00000.zb").write_bytes(b"partial")
        if owner is not None:
            (folder / leftovers.OWNER).write_text(json.dumps(owner))
    _, logs = run_prepare(tmp_path, [path], out="ds[1]")
    assert (out / MANIFEST).is_file() and not (out / leftovers.OWNER).exists()
    assert not (tmp_path / ".ds[1].tmp-dead").exists()
    assert any(f"removed {tmp_path / '.ds[1].tmp-dead'}" in line and f"pid {owners['dead']['pid']}" in line
               for line in logs), logs
    for name, why in (("live", f"still running (pid {os.getpid()}"), ("remote", "which this host cannot check"),
                      ("unrecorded", "no owner record")):
        folder = tmp_path / f".ds[1].tmp-{name}"
        assert (folder / "train-00000.zb").is_file(), name  # left as it was
        assert any(line.startswith(f"warning: {folder} ") and why in line for line in logs), (name, logs)
    assert leftovers.temporary_folders(out) == sorted(tmp_path / f".ds[1].tmp-{n}" for n in ("live", "remote",
                                                                                              "unrecorded"))


def test_a_full_disk_while_preparing_is_exit_5_naming_the_directory(tmp_path, monkeypatch, capsys):
    import errno
    import os

    from zaya.data.cache import resolve_dataset
    from zaya.core.errors import DiskFullError

    def full(self, ids, end_of_document, mask=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(BundleWriter, "write", full)
    (tmp_path / "a.txt").write_text("some text\n")
    out = tmp_path / "deep" / "ds"
    assert main(["data", "prepare", "--input", str(tmp_path / "a.txt"), "--vocab-size", "320", "--out",
                 str(out)]) == 5
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"zaya: error: writing the dataset {out}: {out.parent}: No space left on device (")
    assert "MiB free there" in last and "--out" in last and "Traceback" not in err
    assert not out.exists() and not leftovers_of(out)
    # A built-in corpus prepared into zaya's cache: the fix names the cache's variable.
    monkeypatch.setattr(prepare_mod, "_prepare", lambda opts, log: BundleWriter.write(None, None, True))
    with pytest.raises(DiskFullError, match=r"free space, or set ZAYA_CACHE_DIR to a directory") as caught:
        resolve_dataset("builtin:shakespeare", 320, tmp_path / "cache", log=lambda m: None)
    assert f"{tmp_path / 'cache' / 'datasets'}: No space left" in str(caught.value) and caught.value.exit_code == 5


def leftovers_of(out: Path) -> list[Path]:
    from zaya.data.leftovers import temporary_folders

    return temporary_folders(out)
