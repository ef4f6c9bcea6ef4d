"""The data pipeline: loader throughput, bundles against one file per document, and ``prepare`` throughput.

Everything runs in a temporary directory that the script fills itself and deletes at the end (``--keep`` keeps it).
There are three measurements:

(a) **Loader throughput** (``loader_tokens_per_s``). The script writes a prepared dataset of ``--loader-tokens``
    tokens (50M by default). It writes the bundles directly with ``BundleWriter``, using uint16 ids drawn uniformly
    from a tokenizer's vocabulary and documents of lognormal length (mean about 1,000 tokens, median about 600;
    ``--doc-tokens`` changes the mean), each ended by eos. About 1% of the documents go to a ``val`` split. The
    ``tokenizer.json`` and ``manifest.json`` are real: the tokenizer is a byte-level BPE that ``Tokenizer.train``
    learns from 1 MB of Shakespeare. The manifest comes from ``zaya.data.prepare._manifest``, the function
    ``prepare`` itself uses. The dataset is opened with ``PreparedDataset(verify=True)``, so every checksum is
    checked. Batches come from ``DataLoader(..., [Stage(seq_len=4096, micro_batch_size=8)])`` through its public
    iterator, with the default prefetch thread, as the consumer of a training step would take them. After
    ``--warmup-batches``, the script times ``--windows`` windows of ``--window-batches`` batches each and reports
    the median window's input tokens/s (8 x 4096 per batch). Extra keys: ``loader_tokens_per_s_positions`` is the
    same with ``document_positions=True``, and ``loader_tokens_per_s_no_prefetch`` is the same with ``prefetch=0``
    (batches computed in the consumer's thread). The dataset was just written, so it sits in the page cache, as a
    dataset read every epoch does.

(b) **Bundles against one file per document** (``opens_*``, ``read_s_*``). The script synthesises the same kind of
    documents again, ``--compare-tokens`` tokens of them (10M by default). It writes them once as bundles, rolling
    to a new bundle at ``--bundle-mb`` as ``prepare`` does (1,024 MB by default, so 10M tokens make one bundle). It
    writes them again as one raw ``np.uint16`` ``.bin`` file per document (the document's ids, without eos; all in
    one directory). It then runs ``sync`` so that no page is dirty. Each read pass opens every file of one layout
    and reads all its bytes into a numpy array (``os.open`` + ``fstat`` + ``os.readv`` into a fresh array). The loop
    counts its own ``open`` calls, and no directory listing is timed or counted. For a bundle, the pass also parses
    the header and views the tokens and the index without copying. A check outside the timed region confirms that
    both layouts give the same documents.

    - "Cold" passes: ``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` is called on every file just before the
      pass, in an untimed pass that is not counted as opens. This needs no root on Linux and evicts the file's
      clean pages from the page cache. The timed pass then reads from the disk, or from whatever caches the
      hypervisor keeps. Inodes and directory entries stay cached, so "cold-ish": the data is cold, the metadata
      warm.
    - "Warm" passes: the same reads right after a pass that loaded everything into the page cache.

    Dropping the whole page cache (``/proc/sys/vm/drop_caches``) needs root, so the script does not do it. When
    ``posix_fadvise`` exists, ``read_s_bundled`` / ``read_s_per_doc`` are the cold medians, and the warm medians are
    ``read_s_*_warm``. Without it, the main keys are the warm ones and ``read_cold`` is false. Layouts alternate
    within each of ``--read-repeats`` rounds, and each figure is the median over the rounds.

(c) **``prepare`` throughput** (``prepare_mb_per_s_1`` / ``_2``). The input is ``--prepare-mb`` MB of JSON Lines
    (32 MB by default). Each record is a document of lognormal length (mean about 4 KB) made of Shakespeare
    paragraphs (``zaya.data.corpus.load_corpus_text()``), shuffled and repeated. ``prepare()`` runs with the
    tokenizer of (a) passed as ``PrepareOptions(tokenizer=...)``, so no tokenizer training is timed, with
    ``workers=1`` and ``workers=2``. The throughput is the input bytes (what ``prepare`` counts and shows in its
    progress) over the wall time of the whole ``prepare()`` call, which includes starting the worker pool, writing
    the bundles and their checksums, and renaming the directory into place. The text without its JSON quoting is
    ``prepare_text_mb``. Worker counts alternate within each of ``--prepare-repeats`` rounds, and the medians are
    reported. With ``workers=1``, the ``tokenizers`` library still spreads each batch over its own thread pool
    (``TOKENIZERS_PARALLELISM`` is left as the user has it). Each ``workers=N`` process runs single-threaded.

Run: ``PYTHONPATH=src python benchmarks/data_loader.py [--quick] [--loader-tokens N] [--compare-tokens N]
[--prepare-mb MB]`` (``--quick`` shrinks every size for a smoke run of a few seconds). Human-readable progress goes
to stderr, and the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from zaya.data.bundle import BUNDLE_SUFFIX, HEADER, MANIFEST, TOKENIZER, BundleWriter, PreparedDataset, sha256_file
from zaya.data.tokenizer import Tokenizer

SEQ_LEN = 4096
MICRO_BATCH = 8
DOC_MEAN_TOKENS = 1000.0
DOC_SIGMA = 1.0  # lognormal sigma: median = mean * exp(-sigma^2 / 2) ~ 607 tokens, a long right tail
TEXT_DOC_MEAN_BYTES = 4000.0
HAVE_FADVISE = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


# --- synthetic data ------------------------------------------------------------------------------------------------
def train_tokenizer(directory: Path, vocab_size: int) -> tuple[Tokenizer, Path]:
    from zaya.data.corpus import load_corpus_text

    t0 = time.perf_counter()
    tokenizer = Tokenizer.train([load_corpus_text(max_bytes=1_000_000)], vocab_size)
    path = directory / "tokenizer.json"
    tokenizer.save(path)
    tokenizer = Tokenizer.from_file(path)  # as prepare loads it (source = the path)
    log(f"tokenizer: {vocab_size}-entry BPE trained on 1 MB of Shakespeare in {time.perf_counter() - t0:.1f} s "
        f"({tokenizer.max_id + 1} ids, {tokenizer.dtype}, eos {tokenizer.special.eos})")
    return tokenizer, path


def synth_documents(rng: np.random.Generator, tokens: int, tokenizer: Tokenizer,
                    mean_tokens: float = DOC_MEAN_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """Documents totalling at least ``tokens`` ids (eos included): the ids back to back, and the document bounds.

    Document ``i`` is ``flat[bounds[i]:bounds[i + 1]]``; its last id is eos, the others are uniform over the
    vocabulary's non-special ids. Lengths are lognormal with mean about ``mean_tokens``.
    """
    mu = np.log(mean_tokens) - DOC_SIGMA ** 2 / 2
    lengths: list[np.ndarray] = []
    total = 0
    while total < tokens:
        size = max(1024, int(tokens / mean_tokens))
        chunk = np.maximum(1, rng.lognormal(mu, DOC_SIGMA, size=size)).astype(np.int64)
        lengths.append(chunk)
        total += int(chunk.sum()) + len(chunk)
    length = np.concatenate(lengths) + 1  # + eos
    length = length[: int(np.searchsorted(np.cumsum(length), tokens)) + 1]
    bounds = np.concatenate([[0], np.cumsum(length)])
    special = {tokenizer.special.pad, tokenizer.special.bos, tokenizer.special.eos}
    low = max(special) + 1
    flat = rng.integers(low, tokenizer.max_id + 1, size=int(bounds[-1]), dtype=np.uint16)
    flat[bounds[1:] - 1] = tokenizer.special.eos
    return flat, bounds


def write_split(directory: Path, split: str, flat: np.ndarray, bounds: np.ndarray, docs: np.ndarray,
                bundle_bytes: int) -> dict:
    """Write documents ``docs`` (indices into ``bounds``) as bundles of ``split``, as prepare's split writer does."""
    entries = []
    writer = None
    for i in docs.tolist():
        if writer is None:
            writer = BundleWriter(directory / f"{split}-{len(entries):05d}{BUNDLE_SUFFIX}", flat.dtype)
        writer.write(flat[bounds[i]:bounds[i + 1]], True)
        if writer.bytes_written >= bundle_bytes:
            entries.append(writer.close())
            writer = None
    if writer is not None:
        entries.append(writer.close())
    return {"tokens": sum(e["tokens"] for e in entries), "documents": sum(e["documents"] for e in entries),
            "bundles": entries}


def write_dataset(directory: Path, tokenizer: Tokenizer, tokenizer_path: Path, flat: np.ndarray,
                  bounds: np.ndarray, bundle_bytes: int, val_fraction: float, seed: int) -> PreparedDataset:
    """A prepared dataset directory (bundles, tokenizer.json, manifest.json) holding these documents."""
    from zaya.data.prepare import PrepareOptions, _manifest
    from zaya.data.sources import InputStats

    directory.mkdir(parents=True)
    n = len(bounds) - 1
    is_val = np.random.default_rng(seed).random(n) < val_fraction
    splits = {"train": write_split(directory, "train", flat, bounds, np.nonzero(~is_val)[0], bundle_bytes),
              "val": write_split(directory, "val", flat, bounds, np.nonzero(is_val)[0], bundle_bytes)}
    shutil.copyfile(tokenizer_path, directory / TOKENIZER)
    opts = PrepareOptions(inputs=["<synthetic: benchmarks/data_loader.py>"], out=str(directory),
                          tokenizer=str(tokenizer_path), bundle_mb=bundle_bytes / 1e6, val_fraction=val_fraction,
                          seed=seed)
    manifest = _manifest(opts, tokenizer, splits, InputStats(documents=n), sha256_file(directory / TOKENIZER))
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return PreparedDataset(directory, verify=True)


# --- (a) loader ----------------------------------------------------------------------------------------------------
def loader_rate(dataset: PreparedDataset, positions: bool, prefetch: int | None, warmup: int, windows: int,
                window_batches: int, seed: int) -> tuple[float, list[float]]:
    """Median tokens/s over timed windows of batches from the public iterator, after ``warmup`` batches."""
    from zaya.data.loader import DataLoader, Stage

    stage = Stage("bench", seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH, weights={"synthetic": 1.0})
    kwargs = {} if prefetch is None else {"prefetch": prefetch}
    loader = DataLoader({"synthetic": dataset}, [stage], seed=seed, document_positions=positions, **kwargs)
    it = iter(loader)
    try:
        for _ in range(warmup):
            batch = next(it)
        assert tuple(batch.input_ids.shape) == (MICRO_BATCH, SEQ_LEN), batch.input_ids.shape
        assert bool((batch.input_ids[:, 1:] == batch.labels[:, :-1]).all())
        assert int(batch.input_ids.max()) < dataset.vocab_size
        assert positions == (batch.position_ids is not None)
        rates = []
        for _ in range(windows):
            t0 = time.perf_counter()
            for _ in range(window_batches):
                next(it)
            rates.append(window_batches * MICRO_BATCH * SEQ_LEN / (time.perf_counter() - t0))
    finally:
        loader.close()
    return statistics.median(rates), rates


# --- (b) bundles against one file per document ---------------------------------------------------------------------
def write_per_document(directory: Path, flat: np.ndarray, bounds: np.ndarray) -> list[Path]:
    directory.mkdir(parents=True)
    paths = []
    for i in range(len(bounds) - 1):
        path = directory / f"doc-{i:07d}.bin"
        with open(path, "wb") as fh:
            fh.write(flat[bounds[i]:bounds[i + 1] - 1].tobytes())  # the document's ids, without eos
        paths.append(path)
    return paths


def drop_cache(paths: list[Path]) -> None:
    """Evict the files' (clean) pages from the page cache; no root needed."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_whole(path: Path) -> np.ndarray:
    """One open, then every byte of the file into a fresh numpy buffer."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = np.empty(size, dtype=np.uint8)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise OSError(f"{path}: file shrank while reading")
            got += n
        return buf
    finally:
        os.close(fd)


def read_bundles(paths: list[Path]) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
    opens, out = 0, []
    for path in paths:
        buf = read_whole(path)
        opens += 1
        _, _, width, tokens, documents, token_offset, index_offset = HEADER.unpack(buf[:HEADER.size].tobytes())
        dtype = np.dtype("<u2") if width == 2 else np.dtype("<u4")
        out.append((buf[token_offset:token_offset + tokens * width].view(dtype),
                    buf[index_offset:index_offset + (documents + 1) * 8].view("<u8")))
    return opens, out


def read_per_document(paths: list[Path]) -> tuple[int, list[np.ndarray]]:
    opens, out = 0, []
    for path in paths:
        out.append(read_whole(path).view("<u2"))
        opens += 1
    return opens, out


def same_documents(bundled: list[tuple[np.ndarray, np.ndarray]], per_doc: list[np.ndarray]) -> bool:
    k = 0
    for tokens, index in bundled:
        for a, b in zip(index[:-1].tolist(), index[1:].tolist()):
            if k >= len(per_doc) or not np.array_equal(tokens[a:b - 1], per_doc[k]):
                return False
            k += 1
    return k == len(per_doc)


def compare_layouts(root: Path, tokenizer: Tokenizer, tokens: int, bundle_bytes: int, repeats: int,
                    seed: int) -> dict:
    flat, bounds = synth_documents(np.random.default_rng(seed + 1), tokens, tokenizer)
    n_docs = len(bounds) - 1
    t0 = time.perf_counter()
    bundled_dir = root / "bundled"
    bundled_dir.mkdir(parents=True)
    entries = write_split(bundled_dir, "train", flat, bounds, np.arange(n_docs), bundle_bytes)["bundles"]
    bundle_paths = [bundled_dir / e["file"] for e in entries]
    t1 = time.perf_counter()
    doc_paths = write_per_document(root / "per_doc", flat, bounds)
    if hasattr(os, "sync"):
        os.sync()  # fadvise only evicts clean pages
    t2 = time.perf_counter()
    bundle_bytes_total = sum(p.stat().st_size for p in bundle_paths)
    doc_bytes_total = sum(p.stat().st_size for p in doc_paths)
    log(f"layouts: {n_docs:,} documents, {int(bounds[-1]):,} tokens: {len(bundle_paths)} bundle(s) "
        f"({bundle_bytes_total / 1e6:.1f} MB, written in {t1 - t0:.1f} s incl. fsync + sha256) and {n_docs:,} "
        f"per-document files ({doc_bytes_total / 1e6:.1f} MB, written + synced in {t2 - t1:.1f} s)")

    opens_b, got_b = read_bundles(bundle_paths)
    opens_d, got_d = read_per_document(doc_paths)
    if not same_documents(got_b, got_d):
        raise SystemExit("the bundled and per-document layouts hold different documents; not timing")
    del got_b, got_d

    layouts = {"bundled": (read_bundles, bundle_paths), "per_doc": (read_per_document, doc_paths)}
    times: dict[str, list[float]] = {f"{name}_{kind}": [] for name in layouts for kind in ("cold", "warm")}
    kinds = ("cold", "warm") if HAVE_FADVISE else ("warm",)
    for _ in range(repeats):
        for name, (reader, paths) in layouts.items():
            for kind in kinds:
                if kind == "cold":
                    drop_cache(paths)
                else:
                    reader(paths)  # make sure every page is cached
                t = time.perf_counter()
                reader(paths)
                times[f"{name}_{kind}"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    main = "cold" if HAVE_FADVISE else "warm"
    out = {
        "opens_bundled": opens_b,
        "opens_per_doc": opens_d,
        "read_s_bundled": round(med[f"bundled_{main}"], 4),
        "read_s_per_doc": round(med[f"per_doc_{main}"], 4),
        "read_cold": HAVE_FADVISE,
        "read_s_bundled_warm": round(med["bundled_warm"], 4),
        "read_s_per_doc_warm": round(med["per_doc_warm"], 4),
        "compare_tokens": int(bounds[-1]),
        "compare_documents": n_docs,
    }
    out["open_ratio"] = round(opens_d / opens_b, 1)
    out["read_ratio"] = round(out["read_s_per_doc"] / out["read_s_bundled"], 2)
    out["read_ratio_warm"] = round(out["read_s_per_doc_warm"] / out["read_s_bundled_warm"], 2)
    for k, v in times.items():
        if v:
            log(f"read {k}: " + ", ".join(f"{x:.4f}" for x in v) + " s")
    return out


# --- (c) prepare ---------------------------------------------------------------------------------------------------
def write_text_input(path: Path, megabytes: float, seed: int) -> int:
    """JSON Lines of Shakespeare paragraphs, shuffled and repeated into documents; returns the text's UTF-8 bytes."""
    from zaya.data.corpus import load_corpus_text

    paragraphs = [p.strip() + "\n" for p in load_corpus_text().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    mu = np.log(TEXT_DOC_MEAN_BYTES) - 0.5
    target = int(megabytes * 1e6)
    written = text_bytes = 0
    order: list[str] = []
    with open(path, "w", encoding="utf-8") as fh:
        while written < target:
            want = max(64, int(nrng.lognormal(mu, 1.0)))
            parts, size = [], 0
            while size < want:
                if not order:
                    order = paragraphs[:]
                    rng.shuffle(order)
                parts.append(order.pop())
                size += len(parts[-1])
            text = "\n".join(parts)
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            fh.write(line)
            written += len(line.encode("utf-8"))
            text_bytes += len(text.encode("utf-8"))
    return text_bytes


def measure_prepare(root: Path, tokenizer_path: Path, megabytes: float, repeats: int, seed: int) -> dict:
    from zaya.data.prepare import PrepareOptions, prepare

    source = root / "text" / "input.jsonl"
    source.parent.mkdir(parents=True)
    text_bytes = write_text_input(source, megabytes, seed)
    input_bytes = source.stat().st_size
    log(f"prepare input: {input_bytes / 1e6:.1f} MB of JSON Lines ({text_bytes / 1e6:.1f} MB of text)")
    rates: dict[int, list[float]] = {1: [], 2: []}
    for r in range(repeats):
        for workers in rates:
            out = root / f"prepared-w{workers}-{r}"
            opts = PrepareOptions(inputs=[str(source)], out=str(out), tokenizer=str(tokenizer_path), workers=workers,
                                  bundle_mb=1024.0)
            t0 = time.perf_counter()
            result = prepare(opts, log=lambda m: None)
            seconds = time.perf_counter() - t0
            assert result.stats.bytes == input_bytes, (result.stats.bytes, input_bytes)
            rates[workers].append(input_bytes / 1e6 / seconds)
            tokens = result.manifest["splits"]["train"]["tokens"] + result.manifest["splits"]["val"]["tokens"]
            log(f"prepare workers={workers}: {seconds:.2f} s, {rates[workers][-1]:.2f} MB/s, {tokens:,} tokens")
            shutil.rmtree(out)
    return {"prepare_mb_per_s_1": round(statistics.median(rates[1]), 2),
            "prepare_mb_per_s_2": round(statistics.median(rates[2]), 2),
            "prepare_input_mb": round(input_bytes / 1e6, 1), "prepare_text_mb": round(text_bytes / 1e6, 1),
            "prepare_tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run (overrides the size defaults)")
    p.add_argument("--loader-tokens", type=int, default=None, help="tokens of the loader's dataset (default 50M)")
    p.add_argument("--compare-tokens", type=int, default=None, help="tokens of (b)'s documents (default 10M)")
    p.add_argument("--prepare-mb", type=float, default=None, help="MB of text prepared in (c) (default 32)")
    p.add_argument("--bundle-mb", type=float, default=1024.0, help="bundle size, as prepare's --bundle-mb")
    p.add_argument("--doc-tokens", type=float, default=DOC_MEAN_TOKENS,
                   help="mean document length in tokens of (a)'s dataset (more documents per bundle when smaller)")
    p.add_argument("--warmup-batches", type=int, default=None, help="untimed loader batches first (default 30)")
    p.add_argument("--windows", type=int, default=None, help="timed loader windows (default 7)")
    p.add_argument("--window-batches", type=int, default=None, help="batches per timed window (default 100)")
    p.add_argument("--read-repeats", type=int, default=None, help="rounds of (b)'s read passes (default 3)")
    p.add_argument("--prepare-repeats", type=int, default=None, help="rounds of (c)'s prepare runs (default 2)")
    p.add_argument("--vocab-size", type=int, default=8192, help="size of the BPE trained for the datasets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", default=None, help="where to make the temporary directory (default: the system's)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(loader_tokens=4_000_000 if quick else 50_000_000, compare_tokens=1_000_000 if quick else 10_000_000,
                    prepare_mb=2.0 if quick else 32.0, warmup_batches=5 if quick else 30, windows=3 if quick else 7,
                    window_batches=20 if quick else 100, read_repeats=1 if quick else 3,
                    prepare_repeats=1 if quick else 2)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
        if getattr(args, k) <= 0:
            p.error(f"--{k.replace('_', '-')} must be positive")
    if args.doc_tokens < 1:
        p.error("--doc-tokens must be at least 1")
    if args.loader_tokens < 2 * MICRO_BATCH * (SEQ_LEN + 1):
        p.error(f"--loader-tokens must be at least {2 * MICRO_BATCH * (SEQ_LEN + 1)}")

    start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="zaya-bench-data-", dir=args.tmpdir))
    log(f"working in {root}")
    result: dict = {}
    try:
        tokenizer, tokenizer_path = train_tokenizer(root, args.vocab_size)
        bundle_bytes = int(args.bundle_mb * 1e6)

        # (a)
        t0 = time.perf_counter()
        flat, bounds = synth_documents(np.random.default_rng(args.seed), args.loader_tokens, tokenizer,
                                       args.doc_tokens)
        dataset = write_dataset(root / "loader", tokenizer, tokenizer_path, flat, bounds, bundle_bytes,
                                val_fraction=0.01, seed=args.seed)
        del flat, bounds
        train = dataset.split("train")
        log(f"loader dataset: {train.num_tokens:,} train tokens in {train.num_documents:,} documents, "
            f"{len(train.bundles)} bundle(s), written and verified in {time.perf_counter() - t0:.1f} s")
        rate_args = (args.warmup_batches, args.windows, args.window_batches, args.seed)
        for key, positions, prefetch in (("loader_tokens_per_s", False, None),
                                         ("loader_tokens_per_s_positions", True, None),
                                         ("loader_tokens_per_s_no_prefetch", False, 0)):
            rate, rates = loader_rate(dataset, positions, prefetch, *rate_args)
            result[key] = round(rate)
            log(f"{key}: median {rate / 1e6:.1f}M tokens/s (windows: "
                + ", ".join(f"{r / 1e6:.1f}M" for r in rates) + ")")
        result["loader_dataset_tokens"] = train.num_tokens
        result["loader_dataset_documents"] = train.num_documents
        del dataset, train

        # (b)
        result.update(compare_layouts(root / "layouts", tokenizer, args.compare_tokens, bundle_bytes,
                                      args.read_repeats, args.seed))
        log(f"opens: {result['opens_bundled']} bundled vs {result['opens_per_doc']:,} per document; read "
            f"{'cold' if result['read_cold'] else 'warm'}: {result['read_s_bundled']:.4f} s vs "
            f"{result['read_s_per_doc']:.4f} s ({result['read_ratio']}x); warm: {result['read_s_bundled_warm']:.4f} s "
            f"vs {result['read_s_per_doc_warm']:.4f} s ({result['read_ratio_warm']}x)")
        shutil.rmtree(root / "layouts")

        # (c)
        result.update(measure_prepare(root, tokenizer_path, args.prepare_mb, args.prepare_repeats, args.seed))
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["quick"] = quick
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
