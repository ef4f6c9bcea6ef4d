"""The ``zaya`` command: parse arguments, call one function per verb, print the result.

Heavy modules (torch, the model) are imported inside each verb, so ``zaya --help`` is instant. Errors a user can
fix (a bad config key, a missing directory, an existing destination) print one line, ``zaya: error: ...``, and exit
with status 2; set ZAYA_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence


def _cmd_train(args: argparse.Namespace) -> int:
    from zaya.config import load_config

    config = load_config(args.config)
    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.out is not None:
        overrides["out_dir"] = args.out
    if overrides:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, **overrides))

    from zaya.train.skeleton import train

    train(config)
    return 0


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_flatten(value, f"{name}."))
        else:
            rows.append((name, value))
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if value.is_integer() and abs(value) >= 1e4 else f"{value:,.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def _cmd_info(args: argparse.Namespace) -> int:
    from zaya.config import load_config
    from zaya.model.info import model_info

    config = load_config(args.config)
    info = model_info(config.model)
    if args.json:
        print(json.dumps(info))
        return 0
    rows = _flatten(info)
    cells = [(key, _fmt(value)) for key, value in rows]
    key_width = max((len(k) for k, _ in cells), default=0)
    value_width = max((len(v) for _, v in cells), default=0)
    print(f"{args.config}")
    for key, value in cells:
        print(f"  {key:<{key_width}}  {value:>{value_width}}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from zaya.model.hf import convert

    dst = convert(args.src, args.dst, to=args.to, dtype=args.dtype, overwrite=args.force)
    print(f"wrote {dst}")
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from zaya.data.prepare import PrepareOptions, prepare

    opts = PrepareOptions(
        inputs=args.input, out=args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        tokenizer_sample_mb=args.tokenizer_sample_mb, bundle_mb=args.bundle_mb, val_fraction=args.val_fraction,
        seed=args.seed, workers=args.workers, strict=args.strict, text_field=args.text_field,
        eos_token=args.eos_token, bos_token=args.bos_token, pad_token=args.pad_token, force=args.force)
    log = (lambda message: print(message, file=sys.stderr))
    result = prepare(opts, log=log)
    m = result.manifest
    train, val = m["splits"]["train"], m["splits"]["val"]
    print(f"wrote {result.out}: {train['tokens']:,} train tokens in {train['documents']:,} documents "
          f"({len(train['bundles'])} bundle(s)), {val['tokens']:,} validation tokens in {val['documents']:,}; "
          f"vocab {m['tokenizer']['vocab_size']:,}, {m['dtype']}; {result.stats.bytes / 1e6:,.1f} MB of text in "
          f"{result.seconds:.1f} s ({result.mb_per_s:.2f} MB/s)")
    return 0


def _cmd_data_inspect(args: argparse.Namespace) -> int:
    from zaya.data.inspect import summarize

    info = summarize(args.dir, verify=args.verify, sample_tokens=args.sample_tokens)
    if args.json:
        print(json.dumps(info))
        return 0
    tok = info["tokenizer"]
    print(f"{info['directory']}  (format {info['format_version']}, {info['dtype']})")
    print(f"  tokenizer  {tok['source']}, vocab {tok['vocab_size']:,} (model: {tok['padded_vocab_size']:,}), "
          f"eos {tok['eos_id']} {tok['eos_token']!r}, sha256 {tok['sha256'][:12]}")
    for name, split in info["splits"].items():
        print(f"  {name:<5}      {split['tokens']:,} tokens, {split['documents']:,} documents, {split['bundles']} "
              f"bundle(s), {split['bytes'] / 1e6:,.1f} MB; mean document {split['mean_document_tokens']:,.0f} "
              f"tokens, longest {split['max_document_tokens']:,}")
        total = max(1, split["documents"])
        for row in split["length_histogram"]:
            bar = "#" * max(1, round(40 * row["documents"] / total))
            print(f"    {row['min']:>9,}-{row['max']:<9,} {row['documents']:>9,}  {bar}")
    stats = info["stats"]
    if stats:
        print(f"  inputs     {stats['files']:,} file(s), {stats['bytes'] / 1e6:,.1f} MB; {stats['decode_errors']} "
              f"invalid UTF-8 sequence(s) replaced, {stats['bad_lines']} bad JSON line(s) skipped, "
              f"{stats['empty_documents']} empty document(s)")
    if info["verified"]:
        print(f"  verified   {len(info['verified'])} file(s): every sha256 matches the manifest")
    print(f"  sample     {info['sample']!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zaya", description="Train and run ZAYA1-style Mixture-of-Experts models.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("train", help="train a model (walking skeleton: byte tokens, built-in corpus, CPU)")
    p.add_argument("--config", required=True, metavar="PATH", help="TOML config, e.g. configs/tiny.toml")
    p.add_argument("--steps", type=int, metavar="N", help="override train.steps")
    p.add_argument("--out", metavar="DIR", help="override train.out_dir (gets model/, the checkpoint, and metrics.json)")
    p.set_defaults(func=_cmd_train)

    p = verbs.add_parser("info", help="parameter counts and FLOPs of a config's model")
    p.add_argument("--config", required=True, metavar="PATH", help="TOML config, e.g. configs/zaya1-base.toml")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.set_defaults(func=_cmd_info)

    p = verbs.add_parser("convert", help="convert a checkpoint between the zaya and Hugging Face layouts")
    p.add_argument("--to", required=True, choices=("hf", "zaya"), help="layout to write")
    p.add_argument("--src", required=True, metavar="DIR", help="zaya checkpoint or Hugging Face directory")
    p.add_argument("--dst", required=True, metavar="DIR", help="directory to write")
    p.add_argument("--dtype", default="keep", choices=("keep", "float32", "bfloat16"),
                   help="weight dtype to write (default: keep the source's)")
    p.add_argument("--force", action="store_true", help="replace --dst if it exists")
    p.set_defaults(func=_cmd_convert)

    p = verbs.add_parser("data", help="prepare and inspect tokenized datasets")
    data = p.add_subparsers(dest="data_verb", required=True, metavar="DATA_VERB")
    p = data.add_parser("prepare", help="tokenize text into bundles + tokenizer.json + manifest.json",
                        description="Inputs: .txt/.md files (one document each), .jsonl (one document per line), "
                                    "directories of them, .gz of any, or builtin:shakespeare.")
    p.add_argument("--input", required=True, nargs="+", action="extend", metavar="PATH",
                   help="files, directories, or builtin:shakespeare (repeatable)")
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory to create")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tokenizer", metavar="FILE", help="use this tokenizer.json (any Hugging Face tokenizer)")
    group.add_argument("--vocab-size", type=int, default=8192, metavar="N",
                       help="train a byte-level BPE of N entries, a multiple of 64 (default 8192)")
    p.add_argument("--tokenizer-sample-mb", type=float, default=512.0, metavar="MB",
                   help="text used to train the tokenizer (default: the first 512 MB)")
    p.add_argument("--bundle-mb", type=float, default=1024.0, metavar="N", help="bundle size (default 1024 MB)")
    p.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                   help="share of documents held out for validation (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split (default 0)")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizer processes (default 1)")
    p.add_argument("--strict", action="store_true", help="fail on invalid UTF-8 or bad JSON lines instead of "
                                                          "replacing/skipping and counting them")
    p.add_argument("--text-field", default="text", metavar="NAME", help="JSON Lines field with the text")
    p.add_argument("--eos-token", metavar="TOKEN", help="end-of-document token of --tokenizer (found by name "
                                                         "otherwise)")
    p.add_argument("--bos-token", metavar="TOKEN", help="beginning-of-document token of --tokenizer")
    p.add_argument("--pad-token", metavar="TOKEN", help="padding token of --tokenizer")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=_cmd_data_prepare)

    p = data.add_parser("inspect", help="summarize a prepared dataset; --verify recomputes every checksum")
    p.add_argument("dir", metavar="DIR", help="a directory written by `zaya data prepare`")
    p.add_argument("--verify", action="store_true", help="recompute every file's sha256 against the manifest")
    p.add_argument("--sample-tokens", type=int, default=64, metavar="N", help="tokens of the decoded sample")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.set_defaults(func=_cmd_data_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, FileExistsError, ValueError) as err:  # ConfigError is a ValueError
        if os.environ.get("ZAYA_DEBUG"):
            raise
        message = str(err) if not isinstance(err, OSError) or err.filename is None else _os_message(err)
        print(f"zaya: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zaya: interrupted", file=sys.stderr)
        return 130


def _os_message(err: OSError) -> str:
    return f"{err.strerror}: {err.filename}" if err.strerror else str(err)


if __name__ == "__main__":
    sys.exit(main())
