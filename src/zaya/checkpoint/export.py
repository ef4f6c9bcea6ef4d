"""One consolidated, inference-ready copy of a model: ``zaya export`` (``zaya convert`` is an alias: ``convert``).

The source is anything ``zaya generate`` accepts (``consolidate.resolve_checkpoint``): a run directory (its newest
complete checkpoint), one training checkpoint (DCP, whatever world size and parallel mode wrote it: its shards are
reassembled in this process), a zaya checkpoint or a Hugging Face ``zaya`` directory. It is written in one of two
layouts (both hold the weights as safetensors; they differ in names and metadata):

- ``hf``: the Hugging Face ``zaya`` layout, config.json + model*.safetensors (``zaya.model.hf``), which
  ``transformers`` loads as well as ``zaya.load_pretrained``;
- ``safetensors``: zaya's own checkpoint directory, zaya.json + model.safetensors (``zaya.model.io``).

The tokenizer found with the source (``consolidate.find_tokenizer``) is copied along with the files that travel
with it (``zaya.data.tokenizer.TOKENIZER_FILES``), so ``zaya generate`` and ``zaya eval`` take the export as it is;
an ``hf`` export also gets tokenizer_config.json, special_tokens_map.json and generation_config.json matching the
model (``hf_tokenizer_files``), so that transformers and lm-eval read it as zaya does. ``SHA256SUMS``
(``zaya.model.checksums``) is written last, listing every file, and every later load of the export checks it.
Everything is written into a temporary sibling directory that is renamed into place only when complete
(``zaya.core.fsutil.atomic_directory``, which also gives the files and directory the modes a plain ``open`` would,
0644 / 0755 under the usual umask): an interrupted export leaves no half-written destination, and with ``overwrite``
an existing one is replaced only once the new one is complete. A non-empty destination is refused without
``overwrite``, and one that is (or holds) the source always.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from zaya.core.device import DTYPES, dtype_name
from zaya.core.errors import ConfigError, writing

FORMATS = {"hf": "Hugging Face zaya layout", "safetensors": "zaya checkpoint"}


def export(checkpoint: str | Path, to: str | Path, format: str = "hf", dtype: str = "keep", overwrite: bool = False,
           log: Callable[[str], None] | None = None) -> Path:
    """Write the model at ``checkpoint`` into the directory ``to`` in ``format`` ("hf" or "safetensors"); returns
    ``to``.

    ``dtype`` "keep" (the default) writes every tensor exactly as stored (for a training checkpoint: the fp32 master
    weights); "float32", "bfloat16" or "float16" casts the floating-point weights, except the router's balancing
    state, which stays fp32. ``overwrite`` replaces an existing non-empty ``to`` (an empty one is always used).
    ``log``, when given, receives one line saying what was written.
    """
    from zaya.checkpoint.consolidate import TOKENIZER, describe, load_for_inference
    from zaya.checkpoint.hf_tokenizer_files import write_hf_tokenizer_files
    from zaya.core.fsutil import atomic_directory
    from zaya.data.chat_template import DEFAULT_TEMPLATE
    from zaya.data.tokenizer import Tokenizer, copy_tokenizer_files
    from zaya.model.checksums import write_checksums
    from zaya.model.hf import write_hf
    from zaya.model.info import parameter_count
    from zaya.model.io import write_checkpoint

    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; choose " + " or ".join(
            f"{name!r} ({what})" for name, what in FORMATS.items()))
    if dtype != "keep" and dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose 'keep' or one of {', '.join(map(repr, DTYPES))}")
    source, to = Path(checkpoint), Path(to)
    if not source.exists():
        raise ConfigError(f"{source}: no such checkpoint or run directory")
    replace = _check_destination(to, source, overwrite)  # before loading: a refusal should not take minutes

    model, tokenizer, directory = load_for_inference(source, dtype=None if dtype == "keep" else DTYPES[dtype])
    with writing(to.parent, f"exporting to {to}"), atomic_directory(to, overwrite=replace) as tmp:
        (write_hf if format == "hf" else write_checkpoint)(model, tmp)
        tokenizer_files = []
        if tokenizer is not None:
            tokenizer_files = copy_tokenizer_files(tokenizer.parent, tmp)
            if format == "hf":
                tokenizer_files += write_hf_tokenizer_files(tmp, Tokenizer.from_file(tmp / TOKENIZER), model.config,
                                                            default_template=DEFAULT_TEMPLATE)
        write_checksums(tmp)
    if log is not None:
        params = list(model.parameters())
        dtypes = "/".join(sorted({dtype_name(p.dtype) for p in params}))
        log(f"wrote {to}: {format} ({FORMATS[format]}), {parameter_count(params):,} parameters, {dtypes}, "
            f"from {describe(directory)}; " + (f"with {', '.join(dict.fromkeys(tokenizer_files))}" if tokenizer_files
                                               else f"no {TOKENIZER} found with the source (generate will need "
                                               "--tokenizer)"))
    return to


CONVERT_LAYOUTS = {"hf": "hf", "zaya": "safetensors"}
"""``zaya convert --to`` names -> ``export`` formats."""


def convert(src: str | Path, dst: str | Path, to: str, dtype: str = "keep", overwrite: bool = False,
            log: Callable[[str], None] | None = None) -> Path:
    """``zaya convert``, the older spelling of ``export``: ``to`` is "hf" or "zaya" (zaya's own layout)."""
    if to not in CONVERT_LAYOUTS:
        raise ConfigError(f"--to must be 'hf' or 'zaya', got {to!r}")
    return export(src, dst, format=CONVERT_LAYOUTS[to], dtype=dtype, overwrite=overwrite, log=log)


def _check_destination(to: Path, source: Path, overwrite: bool) -> bool:
    """Whether ``to`` exists and is to be replaced; refuses a destination that would destroy the source or files."""
    dst, src = to.resolve(), source.resolve()
    if dst == src or dst in src.parents:
        raise ConfigError(f"{to} {'is' if dst == src else 'contains'} the source checkpoint {source}; export to "
                         "another directory")
    if not to.exists():
        return False
    if not to.is_dir():
        raise FileExistsError(f"{to} exists and is not a directory; choose another destination")
    if not overwrite and any(to.iterdir()):
        raise FileExistsError(f"{to} already exists and is not empty; pass --force (overwrite=True) to replace it "
                              "(the old directory is removed only once the new export is complete)")
    return True
