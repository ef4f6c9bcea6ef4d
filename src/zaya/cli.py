"""The ``zaya`` command: parse arguments, call one function per verb, print the result.

Heavy modules (torch, the model) are imported inside each verb, so ``zaya --help`` is instant. Exit codes follow
the table in ``zaya.core.errors`` (docs/architecture.md): 0 finished, 2 a config or input error, 3 a data error, 4 a
non-finite loss, 5 a checkpoint failure, 6 a collective timeout or lost peer, 75 stopped by a signal with a
checkpoint written, 70 an internal error (a bug: the traceback is printed). A known error prints one line,
``zaya: error: ...``; set ZAYA_DEBUG=1 to see its traceback too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from typing import Any, Sequence

from zaya.core import errors

TREE_METHODS = ("tree", "butterfly", "ring", "ring-partials")
"""``zaya.serve.tree.METHODS``, restated so that parsing the command line imports no torch (a test checks
that the two agree)."""
DEFAULT_EVAL_SEQ_LEN = 512
"""``zaya eval --data``'s sequence length when not given, on a model whose context is longer."""
INFERENCE_DTYPE_HELP = ("weights and compute (default: float32 on the CPU, bfloat16 on a GPU; the same for generate, "
                        "serve and eval)")

# Verbs that only read and write files (no training or model step): a ValueError there is about their input.
_FILE_VERBS = {"info", "export", "convert", "plot", "data", "aegis", "chaos", "plan"}


def _train_overrides(args: argparse.Namespace) -> list[str]:
    """The --set overrides of ``zaya train`` / ``zaya run``, with --run-dir, --max-steps, --device and --init-from
    folded in."""
    overrides = list(args.set or [])
    if args.run_dir is not None:
        overrides.append(f"train.run_dir={json.dumps(args.run_dir)}")
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.device is not None:
        overrides.append(f"train.device={json.dumps(args.device)}")
    if args.init_from is not None:
        overrides.append(f"train.init_from={json.dumps(args.init_from)}")
    return overrides


def _cmd_train(args: argparse.Namespace) -> int:
    from zaya.config import load_config

    config = load_config(args.config, _train_overrides(args))

    from zaya.aegis import trainer_callbacks
    from zaya.aegis.standby import STANDBY_ENV, wait_for_go
    from zaya.train.trainer import train

    resume = args.resume
    if os.environ.get(STANDBY_ENV):  # a warm standby of `zaya run`: imported, now wait for the restart
        resume = wait_for_go(os.environ[STANDBY_ENV])
    # Under `zaya run` the ranks write heartbeats and apply rewind directives (and chaos faults when asked).
    summary = train(config, resume=resume, callbacks=trainer_callbacks())
    return errors.INTERRUPTED if summary.get("interrupted") else errors.FINISHED


def _cmd_run(args: argparse.Namespace) -> int:
    """``zaya run``: ``zaya train`` under torchrun, supervised by Aegis (docs/operations.md)."""
    from zaya.aegis.supervisor import Launch, Supervisor
    from zaya.config import load_config

    overrides = _train_overrides(args)
    config = load_config(args.config, overrides)
    if args.chaos not in (None, "live") and not os.path.isfile(args.chaos):
        raise errors.ConfigError(f"--chaos {args.chaos}: no such plan file (a JSON list of faults, or \"live\")")
    nnodes = args.nnodes or os.environ.get("SLURM_NNODES", "1")
    node_rank = args.node_rank if args.node_rank is not None else (
        int(os.environ["SLURM_NODEID"]) if "SLURM_NODEID" in os.environ else None)
    launch = Launch(config_path=os.path.abspath(args.config), train_args=[a for o in overrides for a in ("--set", o)],
                    resume=args.resume, nproc_per_node=args.nproc_per_node, nnodes=str(nnodes), node_rank=node_rank,
                    rdzv_endpoint=args.rdzv_endpoint or "", rdzv_backend=args.rdzv_backend,
                    rdzv_id=args.rdzv_id or os.environ.get("SLURM_JOB_ID", ""),
                    chaos=os.path.abspath(args.chaos) if args.chaos not in (None, "live") else args.chaos)
    return Supervisor(config, launch, echo=not args.quiet).run()


def _cmd_aegis_report(args: argparse.Namespace) -> int:
    from zaya.aegis.events import format_report, summarise

    report = summarise(args.run_dir)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _cmd_chaos(args: argparse.Namespace) -> int:
    from zaya.aegis.chaos import request

    options = {k: v for k, v in (("seconds", args.seconds), ("steps", args.steps), ("bytes", args.bytes),
                                 ("log", args.log), ("device", args.device)) if v is not None}
    print(request(args.run_dir, args.kind, args.rank, **options))
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


def _cmd_export(args: argparse.Namespace) -> int:
    from zaya.checkpoint.export import export

    export(args.checkpoint, args.to, format=args.format, dtype=args.dtype, overwrite=args.force, log=print)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from zaya.checkpoint.export import convert

    convert(args.src, args.dst, to=args.to, dtype=args.dtype, overwrite=args.force, log=print)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from zaya.train.plot import plot_run

    for path in plot_run(args.run_dir, out_dir=args.out):
        print(f"wrote {path}")
    return 0


def _load(args: argparse.Namespace, need_tokenizer: bool, device=None):
    """(model on --device (or ``device``) with its weights in --dtype (default ``default_inference_dtype``: the one
    rule of generate, serve and eval), tokenizer or None, description): loading errors are input errors (exit code
    2)."""
    from zaya.checkpoint.consolidate import describe, load_for_inference
    from zaya.data.tokenizer import Tokenizer
    from zaya.core.device import DTYPES, default_inference_dtype, resolve_device

    device = device if device is not None else resolve_device(args.device)
    args.dtype = args.dtype or default_inference_dtype(device)
    try:
        model, tokenizer_path, directory = load_for_inference(args.checkpoint, device=device,
                                                              dtype=DTYPES[args.dtype])
    except (ValueError, KeyError) as exc:
        if isinstance(exc, errors.ZayaError):
            raise
        raise errors.ConfigError(f"{args.checkpoint}: cannot be loaded ({exc})") from exc
    tokenizer_path = args.tokenizer or tokenizer_path
    if tokenizer_path is None and need_tokenizer:
        raise errors.ConfigError(f"{directory}: no tokenizer.json beside this checkpoint; pass --tokenizer FILE")
    tokenizer = Tokenizer.from_file(tokenizer_path) if tokenizer_path is not None else None
    if tokenizer is not None:  # ids past the model's vocabulary refused; a much smaller tokenizer warned about
        warning = tokenizer.check_model(model.config.vocab_size, model.config.eos_token_id, str(directory))
        if warning:
            print(f"# warning: {warning}", file=sys.stderr)
    return model, tokenizer, describe(directory)


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    if args.max_new_tokens < 0 or args.temperature < 0 or (args.top_p is not None and not 0 < args.top_p <= 1):
        raise errors.ConfigError("--max-new-tokens and --temperature must be >= 0 and --top-p in (0, 1]")
    runtime = _tree_parallel_runtime(args) if args.tree_parallel is not None else None
    try:
        if runtime is None:
            model, tokenizer, where = _load(args, need_tokenizer=True)
        else:  # a rank that cannot load stops every rank (instead of leaving them waiting in the prefill)
            loaded, error = None, None
            try:
                loaded = _load(args, need_tokenizer=True, device=runtime.device)
            except Exception as exc:  # noqa: BLE001 - re-raised by agree, on every rank
                error = exc
            runtime.agree(error, "loading the checkpoint")
            model, tokenizer, where = loaded
        device = next(model.parameters()).device
        eos = model.config.eos_token_id
        prefix = tokenizer.prefix_ids  # what the tokenizer puts before a text, as serve, eval and transformers do
        prompt_ids = prefix + tokenizer.encode(args.prompt)
        if not prompt_ids:
            raise errors.ConfigError(f"--prompt is empty and the tokenizer {tokenizer.source} puts nothing before "
                                     "a text: give a --prompt to continue")
        options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                       top_p=args.top_p, seed=args.seed, eos_token_id=None if args.ignore_eos else eos)
        with torch.no_grad():
            prompt = torch.tensor([prompt_ids], device=device)
            if runtime is None:
                from zaya.model.slots import SlotMemoryError
                from zaya.serve.generate import generate

                try:  # its KV cache holds the prompt and --max-new-tokens, checked before it is allocated
                    out = generate(model, prompt, **options)
                except SlotMemoryError as exc:
                    raise errors.ConfigError(f"{exc.what}: ask for fewer --max-new-tokens (now "
                                             f"{args.max_new_tokens}) or give a shorter --prompt") from None
            else:
                from zaya.serve.tree import tree_generate

                out = tree_generate(model, runtime, prompt, method=args.tree_method, **options)
    finally:
        if runtime is not None:
            from zaya.distributed.runtime import stop

            stop(runtime)
    if runtime is None or runtime.is_main:  # every rank holds the same tokens; one prints them
        text = tokenizer.decode(out[0, len(prefix):].tolist(), skip_special_tokens=True)
        parallel = "" if runtime is None else f", KV cache sharded over {runtime.world_size} ranks"
        print(f"# {where} on {device}{parallel}", file=sys.stderr)
        print(text)
    return 0


def _tree_parallel_runtime(args: argparse.Namespace):
    """The process group for ``--tree-parallel N``: N must be the number of processes torchrun started."""
    from zaya.distributed.runtime import launched_by_torchrun, start

    n = args.tree_parallel
    if n < 1:
        raise errors.ConfigError(f"--tree-parallel {n}: give the number of ranks to shard the KV cache over (>= 1)")
    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
    if world != n:
        started = f"torchrun started {world} processes" if launched_by_torchrun() else "this is one process"
        raise errors.ConfigError(
            f"--tree-parallel {n} shards the KV cache over {n} processes, but {started}: launch it as "
            f"`torchrun --nproc-per-node {n} -m zaya generate ... --tree-parallel {n}` (or pass --tree-parallel "
            f"{world})")
    return start(device=args.device)


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.tasks:
        return _eval_tasks(args)
    if args.data is None:
        raise errors.ConfigError("zaya eval needs --data DIR (perplexity) or --tasks NAMES (lm-evaluation-harness)")
    from zaya.data.bundle import PreparedDataset
    from zaya.data.loader import check_vocabulary
    from zaya.eval.perplexity import evaluate_loss

    model, _, where = _load(args, need_tokenizer=False)
    context = model.config.max_seq_len
    if args.seq_len is None:
        args.seq_len = min(context, DEFAULT_EVAL_SEQ_LEN)
    elif args.seq_len > context:
        raise errors.ConfigError(f"--seq-len {args.seq_len} is longer than the context of {where} ({context} tokens, "
                                 f"its max_seq_len): positions past it were never trained; pass --seq-len {context} "
                                 "or less")
    dataset = PreparedDataset(args.data)
    check_vocabulary(dataset, model.config.vocab_size, model.config.eos_token_id)
    result = evaluate_loss(model, dataset, seq_len=args.seq_len, batch_size=args.batch_size,
                           max_batches=args.max_batches, split=args.split, dtype=args.dtype)
    result = {"checkpoint": where, "data": str(args.data), "device": str(next(model.parameters()).device),
              **result}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{where} on {args.data} [{args.split}]: loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.3f} over {result['tokens']:,} tokens ({result['batches']} batches of "
              f"{args.batch_size} x {args.seq_len})")
    return 0


def _eval_tasks(args: argparse.Namespace) -> int:
    """``zaya eval --tasks``: lm-evaluation-harness tasks on the serving engine (zaya.eval.harness)."""
    import torch

    from zaya.eval.harness import evaluate_tasks

    from zaya.model.slots import SlotMemoryError
    from zaya.serve.limits import context_length

    model, tokenizer, where = _load(args, need_tokenizer=True)
    tasks = [t for t in args.tasks.split(",") if t]
    device = next(model.parameters()).device
    context = context_length(args.max_model_len, model.config.max_seq_len, cap=None)
    try:  # the engine's slots hold the model's max_seq_len unless told: checked before they are allocated
        with torch.no_grad():
            out = evaluate_tasks(model, tokenizer, tasks, include_path=args.include_path, limit=args.limit,
                                 num_fewshot=args.num_fewshot, capacity=context)
    except SlotMemoryError as exc:
        raise errors.ConfigError(f"{exc.what}: pass a smaller --max-model-len (now {context}), the context each "
                                 "slot holds") from None
    if out is None:
        raise errors.ConfigError(f"lm-eval returned no results for {tasks}")
    results = {"checkpoint": where, "tasks": out["results"]}
    if args.json:
        print(json.dumps(results, default=str))
    else:
        for task, metrics in out["results"].items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float))
                              and not isinstance(v, bool))
            print(f"{where} [{task}]: {shown}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """``zaya serve``: the OpenAI-compatible HTTP API on the serving engine (docs/serving.md)."""
    from zaya.core.compile import compile_wanted
    from zaya.core.units import parse_size
    from zaya.serve.gate import API_KEY_ENV
    from zaya.serve.limits import ServeLimits, context_length
    from zaya.serve.server import serve

    for flag, value in (("--max-num-seqs", args.slots), ("--prefill-chunk", args.prefill_chunk),
                        ("--speculative-tokens", args.speculative_tokens), ("--block-size", args.block_size)):
        if value < 1:
            raise errors.ConfigError(f"{flag} must be >= 1, not {value}")
    kv_memory = None if args.kv_cache_memory in (None, "auto") else parse_size(args.kv_cache_memory,
                                                                                "--kv-cache-memory")
    if args.speculative_ngram < 0:
        raise errors.ConfigError(f"--speculative-ngram must be >= 0 (0: off), not {args.speculative_ngram}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        limits = ServeLimits(api_key=api_key, max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts,
                             template_timeout=args.template_timeout, shutdown_timeout=args.shutdown_timeout)
    except ValueError as exc:
        raise errors.ConfigError(f"zaya serve: {exc} (docs/serving.md, \"The server's limits\")") from None
    model, tokenizer, where = _load(args, need_tokenizer=True)
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    context = context_length(args.max_model_len, model.config.max_seq_len)
    print(f"# serving {where} as {name!r} on http://{args.host}:{args.port} (up to {args.slots} sequences of "
          f"{context} tokens)", file=sys.stderr)
    serve(model, tokenizer, host=args.host, port=args.port, model_name=name, num_slots=args.slots,
          capacity=context, prefill_chunk=args.prefill_chunk, limits=limits,
          speculative_ngram=args.speculative_ngram, speculative_tokens=args.speculative_tokens,
          kv_cache_memory=kv_memory, block_size=args.block_size, prefix_caching=not args.no_prefix_caching,
          compile=compile_wanted(args.compile, model.embed.weight.device))
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from zaya.data.prepare import PrepareOptions, prepare

    opts = PrepareOptions(
        inputs=args.input, out=args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        tokenizer_sample_mb=args.tokenizer_sample_mb, bundle_mb=args.bundle_mb, val_fraction=args.val_fraction,
        seed=args.seed, workers=args.workers, strict=args.strict, text_field=args.text_field, format=args.format,
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


def _runs(argv: Sequence[str] | None, *words: str) -> bool:
    """Whether the command line ``argv`` (None: any) runs the command ``words`` (its first plain words)."""
    return argv is None or [a for a in argv if not a.startswith("-")][:len(words)] == list(words)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Every command and its options; given the command line ``argv``, the options of ``tune comm``, ``tune cost``
    and ``plan`` only when it runs that command: declaring them imports torch (about 2 s), which `zaya run`'s
    supervisor, `zaya chaos` or `zaya aegis report` never need."""
    parser = argparse.ArgumentParser(prog="zaya", description="Train and run ZAYA1-style Mixture-of-Experts models.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("train", help="train a model (one process, or under torchrun for many)",
                         description="Train per a TOML config. Under `torchrun --nproc-per-node N -m zaya train ...` "
                                     "every rank runs this command.")
    _train_options(p)
    p.set_defaults(func=_cmd_train)

    p = verbs.add_parser("run", help="train under torchrun, supervised by Aegis (detects and repairs faults)",
                         description="Launch `zaya train` through torchrun on this node and supervise it: heartbeats, "
                                     "exit codes, logs, system metrics; restarts, rewinds, exclusions per the [aegis] "
                                     "policy; events in RUN_DIR/aegis/events.jsonl (docs/operations.md). One per node.")
    _train_options(p)
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="ranks on this node (default 1)")
    p.add_argument("--nnodes", metavar="N|MIN:MAX", help="nodes (default: $SLURM_NNODES or 1)")
    p.add_argument("--node-rank", type=int, metavar="R", help="this node's rank (default: $SLURM_NODEID)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous endpoint of a multi-node job")
    p.add_argument("--rdzv-backend", default="c10d", help="torchrun rendezvous backend (default c10d)")
    p.add_argument("--rdzv-id", metavar="ID", help="rendezvous id (default: $SLURM_JOB_ID)")
    p.add_argument("--chaos", metavar="PLAN|live", help="inject the faults of a chaos plan (JSON), or accept only "
                                                        "`zaya chaos inject` requests (live)")
    p.add_argument("--quiet", action="store_true", help="do not echo the ranks' output (it is in RUN_DIR/aegis/)")
    p.set_defaults(func=_cmd_run)

    p = verbs.add_parser("aegis", help="Aegis tools: report a supervised run")
    aegis = p.add_subparsers(dest="aegis_verb", required=True, metavar="AEGIS_VERB")
    p = aegis.add_parser("report", help="summarise a supervised run's events: faults, actions, detect/recover "
                                        "times, steps redone, ETTR")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory trained under `zaya run`")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_aegis_report)

    p = verbs.add_parser("chaos", help="inject faults into runs (testing Aegis)")
    chaos = p.add_subparsers(dest="chaos_verb", required=True, metavar="CHAOS_VERB")
    p = chaos.add_parser("inject", help="inject one fault into a live `zaya run` now",
                         description="kill/hang signal the rank; xid/ecc/link_down/oom append a line to --log; the "
                                     "others are picked up by the rank after its next step (needs `zaya run --chaos`)")
    p.add_argument("run_dir", metavar="RUN_DIR")
    from zaya.aegis.chaos import KINDS

    p.add_argument("kind", choices=KINDS)
    p.add_argument("--rank", type=int, default=0, help="global rank (default 0)")
    p.add_argument("--seconds", type=float, help="slow/stall: seconds")
    p.add_argument("--steps", type=int, help="slow: steps")
    p.add_argument("--bytes", type=int, help="disk_full: the file-size limit")
    p.add_argument("--log", help="xid/ecc/link_down/oom: the watched log to append to")
    p.add_argument("--device", help="xid/ecc: the device id in the line (default cpu:RANK)")
    p.set_defaults(func=_cmd_chaos)

    p = verbs.add_parser("tune", help="measure this machine: GEMM and collective throughput, into a hardware "
                                      "profile (docs/tuning.md)")
    tune = p.add_subparsers(dest="tune_verb", required=True, metavar="TUNE_VERB")
    p = tune.add_parser("gemm", help="sweep the model's GEMM shapes: TFLOP/s table, heatmap, recommended sizes",
                        description="Time every GEMM the model runs (projections, router, grouped expert GEMMs) over "
                                    "token counts and candidate widths; print a table, write a heatmap PNG, "
                                    "recommend hidden/expert/head sizes and the micro-batch near a parameter budget, "
                                    "and write the measured constants into this device's hardware profile.")
    from zaya.tune.gemm import command as tune_gemm

    tune_gemm.add_arguments(p)
    p.set_defaults(func=tune_gemm.run)
    p = tune.add_parser("comm", help="collective bandwidth by message size and ranks; recommended bucket sizes",
                        description="Measure all-reduce, all-gather, reduce-scatter and all-to-all bandwidth by "
                                    "message size and by how many ranks of the node take part, recommend the gradient "
                                    "bucket size and collective grouping for ddp, zero1 and fsdp, and write them "
                                    "into the hardware profile (the trainer uses them when present).")
    if _runs(argv, "tune", "comm"):
        from zaya.tune import comm as tune_comm

        tune_comm.add_arguments(p)
        p.set_defaults(func=tune_comm.run)
    p = tune.add_parser("cost", help="predict a config's training step time, MFU and top time sinks on H100, H200, "
                                     "MI300X or this CPU (the cost model; docs/tuning.md)",
                        description="Trace one training step of the config's model on fake tensors (every kernel "
                                    "with its FLOPs and bytes) and price it on device profiles, eager and compiled.")
    if _runs(argv, "tune", "cost"):
        from zaya.tune import cost_command as tune_cost

        tune_cost.add_arguments(p)
        p.set_defaults(func=tune_cost.run)

    p = verbs.add_parser("plan", help="memory per GPU, largest micro-batch, run time, checkpoint and data needs of a "
                                      "config on a cluster (docs/tuning.md)",
                         description="Plan a config on N GPUs: parameter, gradient, optimizer and activation memory "
                                     "per GPU for ddp/zero1/fsdp with and without activation checkpointing and "
                                     "context parallelism, the largest micro-batch that fits, tokens/s and time for "
                                     "the token budget, communication per step, checkpoint size and write time, "
                                     "data bandwidth.")
    if _runs(argv, "plan"):
        from zaya.tune import plan as tune_plan

        tune_plan.add_arguments(p)
        p.set_defaults(func=tune_plan.run)

    p = verbs.add_parser("info", help="parameter counts and FLOPs of a config's model")
    p.add_argument("--config", required=True, metavar="PATH", help="TOML config, e.g. configs/zaya1-base.toml")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.set_defaults(func=_cmd_info)

    p = verbs.add_parser("export", help="write one consolidated, inference-ready copy of a model",
                         description="Write the model of a run (its newest complete checkpoint), a training "
                                     "checkpoint (any world size), a zaya checkpoint or a Hugging Face zaya directory "
                                     "as one directory, atomically, with the tokenizer.json found beside it.")
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a run directory, a training checkpoint, a zaya checkpoint or a Hugging Face directory")
    p.add_argument("--to", required=True, metavar="DIR", help="directory to write (refused if it holds files, "
                                                              "unless --force)")
    p.add_argument("--format", default="hf", metavar="hf|safetensors",
                   help="hf: the Hugging Face zaya layout (config.json + safetensors; default); safetensors: zaya's "
                        "own checkpoint (zaya.json + model.safetensors)")
    p.add_argument("--dtype", default="keep", choices=("keep", "float32", "bfloat16"),
                   help="weight dtype to write (default: keep the stored one, bit-exact)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing DIR (only once the new export is complete)")
    p.set_defaults(func=_cmd_export)

    p = verbs.add_parser("convert", help="alias of export: --to hf (--format hf) or --to zaya (--format safetensors)")
    p.add_argument("--to", required=True, choices=("hf", "zaya"), help="layout to write")
    p.add_argument("--src", required=True, metavar="DIR",
                   help="a run directory, a training checkpoint, a zaya checkpoint or a Hugging Face directory")
    p.add_argument("--dst", required=True, metavar="DIR", help="directory to write")
    p.add_argument("--dtype", default="keep", choices=("keep", "float32", "bfloat16"),
                   help="weight dtype to write (default: keep the source's)")
    p.add_argument("--force", action="store_true", help="replace --dst if it exists")
    p.set_defaults(func=_cmd_convert)

    p = verbs.add_parser("plot", help="plot a run's metrics.jsonl: loss, lr, throughput and expert load PNGs")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run's directory (holds metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="directory for the PNGs (default: RUN_DIR/plots)")
    p.set_defaults(func=_cmd_plot)

    p = verbs.add_parser("generate", help="sample text from a run, checkpoint or Hugging Face directory")
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a run directory (its newest checkpoint), a checkpoint directory, or a HF zaya directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="0 disables")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (default: the one beside the checkpoint)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past an end of document")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"), help=INFERENCE_DTYPE_HELP)
    p.add_argument("--device", default="auto", help="auto (default: a GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--tree-parallel", type=int, default=None, metavar="N",
                   help="shard the prompt's KV cache over N ranks and decode with tree attention (launch N "
                        "processes with torchrun; N must be the world size; rank 0 prints)")
    p.add_argument("--tree-method", default="tree", choices=TREE_METHODS,
                   help="how the ranks' partial attention results meet, with --tree-parallel: tree (two "
                        "all-reduces a layer, the default), butterfly (log2 N send/recv rounds of one message: "
                        "half the tree's rounds, fastest on gloo), ring or ring-partials (the "
                        "baselines; docs/long-context.md)")
    p.set_defaults(func=_cmd_generate)

    p = verbs.add_parser("eval", help="perplexity on a prepared dataset, or lm-evaluation-harness tasks")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="as for generate")
    p.add_argument("--data", metavar="DIR", help="a dataset written by `zaya data prepare` (perplexity)")
    p.add_argument("--tasks", metavar="NAMES", help="comma-separated lm-evaluation-harness tasks (instead of --data)")
    p.add_argument("--include-path", metavar="DIR", help="directory of extra task YAML files for --tasks")
    p.add_argument("--limit", type=int, metavar="N", help="--tasks: at most N documents per task")
    p.add_argument("--num-fewshot", type=int, metavar="N", help="--tasks: few-shot examples")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="--tasks: tokens each of the engine's slots holds (default: the model's max_seq_len); the "
                        "slots' KV cache is checked against the memory available")
    p.add_argument("--split", default="val", help="split to evaluate (default val)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help=f"--data: tokens per sequence, at most the model's context (default: the model's context, at "
                        f"most {DEFAULT_EVAL_SEQ_LEN})")
    p.add_argument("--batch-size", type=int, default=8, metavar="N")
    p.add_argument("--max-batches", type=int, default=None, metavar="N", help="default: the whole split")
    p.add_argument("--tokenizer", metavar="FILE", help="unused by eval except to check it loads")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"), help=INFERENCE_DTYPE_HELP)
    p.add_argument("--device", default="auto", help="auto (default: a GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=_cmd_eval)

    from zaya.serve.limits import DEFAULT_MAX_MODEL_LEN, ServeLimits

    p = verbs.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                         description="/v1/completions, /v1/chat/completions (streaming), /v1/models, /health on "
                                     "the continuous-batching engine (docs/serving.md).")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="as for generate")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", metavar="NAME", help="the model id clients send (default: the checkpoint's name)")
    p.add_argument("--max-num-seqs", "--slots", dest="slots", type=int, default=16, metavar="N",
                   help="sequences decoded at once (default 16); more wait in a queue")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="tokens one sequence may reach, prompt and output (default: the model's max_seq_len, at "
                        f"most {DEFAULT_MAX_MODEL_LEN})")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="bytes of the KV block pool all sequences share, e.g. 2G (default auto: every sequence's "
                        "whole context, or what fits in 90%% of the memory available); requests wait for blocks, "
                        "and one that needs more than the pool is refused")
    p.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block (default 16)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks and CCA state of prompt prefixes computed before")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="run the decode step under torch.compile (default auto: on a GPU; on a CPU the first "
                        "compile takes minutes)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="prompt tokens per prefill chunk between decode steps (default 512)")
    p.add_argument("--speculative-ngram", type=int, default=0, metavar="N",
                   help="prompt-lookup speculation for a request decoding alone: draft from the longest recurring "
                        "suffix of up to N tokens of its prompt and output (default 0: off; docs/serving.md)")
    p.add_argument("--speculative-tokens", type=int, default=4, metavar="K",
                   help="draft tokens verified per speculative step (default 4)")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (default: the one beside the checkpoint)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"), help=INFERENCE_DTYPE_HELP)
    p.add_argument("--device", default="auto", help="auto (default: a GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every route but /health "
                                                    "(default: $ZAYA_API_KEY; none: open to whoever can connect)")
    p.add_argument("--max-body-bytes", type=int, default=ServeLimits.max_body_bytes, metavar="N",
                   help="refuse a larger request body with a 413, while reading it (default %(default)s)")
    p.add_argument("--max-prompts", type=int, default=ServeLimits.max_prompts, metavar="N",
                   help="prompts in one /v1/completions request (default %(default)s)")
    p.add_argument("--template-timeout", type=float, default=ServeLimits.template_timeout, metavar="S",
                   help="seconds the chat template may take to render one request (default %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=ServeLimits.shutdown_timeout, metavar="S",
                   help="on SIGTERM/SIGINT, seconds running requests get before they are cancelled (default "
                        "%(default)s)")
    p.set_defaults(func=_cmd_serve)

    p = verbs.add_parser("data", help="prepare and inspect tokenized datasets")
    data = p.add_subparsers(dest="data_verb", required=True, metavar="DATA_VERB")
    p = data.add_parser("prepare", help="tokenize text into bundles + tokenizer.json + manifest.json",
                        description="Inputs: .txt/.md files (one document each), .jsonl (one document per line), "
                                    "Parquet and Arrow files and datasets' save_to_disk folders (one per row), "
                                    "directories of them, .gz of the text ones, or builtin:shakespeare. --format "
                                    "chat reads conversations ({\"messages\": [...]}) with loss masks.")
    p.add_argument("--input", required=True, nargs="+", action="extend", metavar="PATH",
                   help="files, directories, or builtin:shakespeare (repeatable)")
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory to create")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer: a Hugging Face model directory or a "
                                                            "tokenizer.json (its special tokens from the "
                                                            "tokenizer_config.json beside it)")
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
    p.add_argument("--text-field", "--text-column", dest="text_field", default="text", metavar="NAME",
                   help="the JSON Lines field or Parquet / Arrow column with the text (default: text)")
    p.add_argument("--format", choices=("text", "chat"), default="text",
                   help="text: documents; chat: records with 'messages', rendered with the tokenizer's chat "
                        "template (or zaya's default), only the assistant's tokens trained on (default: text)")
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


def _train_options(p: argparse.ArgumentParser) -> None:
    """The options ``zaya train`` and ``zaya run`` share."""
    p.add_argument("--config", required=True, metavar="PATH", help="TOML config, e.g. configs/tiny.toml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value (TOML syntax), e.g. --set optim.lr=1e-3; repeatable")
    p.add_argument("--run-dir", metavar="DIR", help="override train.run_dir")
    p.add_argument("--max-steps", type=int, metavar="N", help="override train.max_steps")
    p.add_argument("--device", metavar="DEVICE", help="override train.device: auto (default: the GPU of each rank "
                                                       "when there is one), cpu, cuda or cuda:N")
    p.add_argument("--init-from", metavar="PATH", help="override train.init_from: start from the weights of a "
                   "Hugging Face zaya directory, a zaya export, a run or a checkpoint (optimizer and step fresh)")
    p.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                   help="auto: continue from the newest complete checkpoint in the run dir (default); never: "
                        "start fresh (an existing run dir is moved aside); PATH: a checkpoint or run directory")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    debug = bool(os.environ.get("ZAYA_DEBUG"))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("zaya: interrupted", file=sys.stderr)
        return errors.INTERRUPTED_AT_ONCE
    except errors.ZayaError as err:
        if debug:
            raise
        print(f"zaya: error: {err}", file=sys.stderr)
        return err.exit_code
    except (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError) as err:
        # A path the user named (a config, a checkpoint, a destination): an input error.
        if debug:
            raise
        message = _os_message(err) if err.filename is not None else str(err)
        print(f"zaya: error: {message}", file=sys.stderr)
        return errors.CONFIG_ERROR
    except ValueError as err:
        if args.verb not in _FILE_VERBS:
            return _internal(err)
        if debug:
            raise
        print(f"zaya: error: {err}", file=sys.stderr)
        return errors.CONFIG_ERROR
    except Exception as err:  # noqa: BLE001 - anything else is a bug, reported as one
        said = _out_of_memory(err)
        if said is None or debug:
            return _internal(err)
        print(f"zaya: error: out of memory{f' ({said})' if said else ''}: the model, batch or context this command "
              "asked for does not fit this machine; make it smaller (model.* sizes, train.micro_batch_size, "
              "--max-model-len, ...) or spread it over more devices (docs/training.md)", file=sys.stderr)
        return errors.CONFIG_ERROR


_OOM = re.compile(r"(?:can't allocate memory|out of memory)(?:[^\n]*?you tried to allocate \d+ bytes)?", re.I)


def _out_of_memory(err: BaseException) -> str | None:
    """What an allocator failure said ("" for a MemoryError; torch's CPU allocator raises a RuntimeError, its GPU
    one an OutOfMemoryError), or None for any other error."""
    if isinstance(err, MemoryError):
        return ""
    match = _OOM.search(str(err)) if isinstance(err, RuntimeError) else None
    return match.group(0)[:200] if match else None


def _internal(err: BaseException) -> int:
    """An exception zaya did not raise on purpose (a torch error inside a step, say): a bug, never a config error."""
    traceback.print_exception(err)
    print(f"zaya: internal error ({type(err).__name__}: {err}); this is a bug: please report it with the traceback "
          "above", file=sys.stderr)
    return errors.INTERNAL_ERROR


def _os_message(err: OSError) -> str:
    return f"{err.strerror}: {err.filename}" if err.strerror else str(err)


if __name__ == "__main__":
    sys.exit(main())
