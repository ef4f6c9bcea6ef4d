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
