"""The printed report of ``zaya tune gemm``: throughput tables, peaks, noise, the recommended shapes and why."""

from __future__ import annotations

from typing import Any, Iterable

from zaya.core.units import format_count
from zaya.tune.gemm.shapes import KINDS
from zaya.tune.gemm.sweep import DIP
from zaya.tune.report import rate

TOP = 5


def unit(values: Iterable[float]) -> tuple[str, float]:
    """The unit a set of TFLOP/s figures reads best in, and the factor to it."""
    return ("TFLOP/s", 1.0) if max(values, default=0) >= 1 else ("GFLOP/s", 1e3)


def grid(result: dict[str, Any], dtype: str) -> dict[str, dict[int, dict[int, dict[str, Any]]]]:
    """kind -> width -> tokens -> {"tflops": fwd or fwd+bwd throughput, "n", "k", "groups", "impl"}."""
    cells: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for r in result["measurements"]:
        if r["dtype"] != dtype:
            continue
        cell = cells.setdefault(r["kind"], {}).setdefault(r["width"], {}).setdefault(
            r["tokens"], {"n": r["n"], "k": r["k"], "groups": r["groups"], "impl": r["impl"], "flops": 0.0,
                          "seconds": 0.0, "ok": True})
        if r["seconds"]:
            cell["flops"] += r["flops"]
            cell["seconds"] += r["seconds"]
        else:
            cell["ok"] = False
    for kind in cells.values():
        for row in kind.values():
            for cell in row.values():
                cell["tflops"] = cell["flops"] / cell["seconds"] / 1e12 if cell["ok"] and cell["seconds"] else None
    return {k: cells[k] for k in KINDS if k in cells}


def what(result: dict[str, Any]) -> str:
    return "forward + backward" if len(result["passes"]) > 1 else "forward"


def table(result: dict[str, Any], dtype: str) -> str:
    from zaya.core.device import short_name

    cells = grid(result, dtype)
    name, scale = unit(c["tflops"] or 0 for k in cells.values() for row in k.values() for c in row.values())
    tokens = result["tokens"]
    lines = [f"{short_name(dtype)} GEMM throughput ({what(result)}), {name}, by tokens per micro-batch:",
             f"  {'kind':<16} {'width':>6} {'N x K':>13} {'impl':>10}" + "".join(f" {t:>9,}" for t in tokens)]
    for kind, rows in cells.items():
        for w, row in sorted(rows.items()):
            any_cell = next(iter(row.values()))
            shape = f"{any_cell['n']}x{any_cell['k']}"
            impl = any_cell["impl"] if any_cell["groups"] > 1 else ""
            vals = "".join(f" {row[t]['tflops'] * scale:>9.3g}" if row.get(t, {}).get("tflops") else f" {'-':>9}"
                           for t in tokens)
            lines.append(f"  {kind:<16} {w:>6} {shape:>13} {impl:>10}{vals}")
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    from zaya.core.device import short_name

    lines = [f"zaya tune gemm: {result['device_name']} ({result['device_key']}), torch {result['torch']}; "
             f"{result['config']}; sweep {result.get('sweep_s', 0):.0f} s"]
    busy = [x for x in (result.get("load_before"), result.get("load_after")) if x is not None]
    if result["device"] == "cpu" and busy and max(busy) > 0.5 * result["threads"]:
        lines.append(f"  note: the load average was {busy[0]:g} before and {busy[-1]:g} after the sweep on "
                     f"{result['threads']} threads: other processes took CPU time, so some figures are low; rerun "
                     "on an idle machine for the record")
    for dtype in result["dtypes"]:
        lines += ["", table(result, dtype)]
        peak = result["peak"].get(dtype, {})
        if peak.get("flops"):
            lines.append(f"  peak: {rate(peak['flops'] / 1e12)} ({peak['kind']}, M x N x K = {peak['shape']}; square "
                         f"{peak['square']['size']} GEMM: {rate(peak['square']['tflops'])})")
        noise = result["recommendation"][dtype]["noise"]
        lines.append(f"  noise: a point's samples spread by {noise:.1%} (median over the points)")
        again = {(r["kind"], r["m"], r["n"], r["k"]) for r in result["measurements"]
                 if r["dtype"] == dtype and r.get("remeasured")}
        if again:
            lines.append(f"  measured again (under {DIP:.0%} of a neighbour's rate; the faster median kept): "
                         f"{len(again)} shape(s)")
    lines.append(f"  (the weight GEMMs; not timed: attention scores and CCA convolutions, "
                 f"{result['untimed_share']:.0%} of the config's forward FLOPs at its seq_len; predictions count "
                 "them at the q/k/v GEMM's rate)")
    if len(result["dtypes"]) > 1:
        a, b = result["dtypes"][:2]
        ra, rb = (result["recommendation"][d]["config"]["tokens_per_s"] for d in (a, b))
        faster, ratio = (a, ra / rb) if ra >= rb else (b, rb / ra)
        lines += ["", f"At the config's shape {short_name(faster)} runs {ratio:.2f}x faster than the other here "
                      f"({short_name(a)} {ra:,.0f}, {short_name(b)} {rb:,.0f} predicted tokens/s of weight GEMMs and "
                      f"attention): train.dtype = \"{faster}\" would train faster on this device."]
    for dtype in result["dtypes"]:
        lines += ["", *_recommendation(result["recommendation"][dtype], dtype)]
    lines.append("")
    for path in result.get("files", []):
        lines.append(f"wrote {path}")
    if result.get("profile"):
        dtypes = [f"peak_flops[{d}]" for d in result["dtypes"] if result["peak"].get(d, {}).get("flops")]
        fields = "gemm summary; --quick leaves peak_flops as it was" if result["quick"] else ", ".join(
            [*dtypes, "gemm summary"])
        lines.append(f"hardware profile: {result['profile']} ({fields}); muon_block_rows, muon_max_blocks, "
                     "muon_cpu_small and loss_chunk_elements are not measured by this command")
    return "\n".join(lines)


def _recommendation(rec: dict[str, Any], dtype: str) -> list[str]:
    """One dtype's ranked shapes (the best ``TOP``, and the config's own), the pick and why."""
    from zaya.core.device import short_name

    lines = [f"Recommended shapes ({short_name(dtype)}; {format_count(rec['budget'])} {rec['budget_of']} "
             f"non-embedding parameters +-{rec['tolerance']:.0%}; predicted fwd+bwd at "
             f"{rec['reference_tokens']:,} tokens per micro-batch; vs config: time per token scaled to the budget):",
             f"  {'':>6} {'hidden':>6} {'expert':>6} {'heads q/kv x dim':>16} {'active':>8} {'total':>8} "
             f"{'budget':>7} {'achieved':>15} {'tokens/s':>10} {'vs config':>9}"]
    shown = rec["ranked"][:TOP]
    rows = [(str(i + 1), r) for i, r in enumerate(shown)]
    if not any(r["config"] for r in shown):
        rows.append(("config", rec["config"]))
    for label, r in rows:
        heads = f"{r['num_query_heads']}/{r['num_kv_heads']} x {r['head_dim']}"
        tag = label + ("*" if r["config"] and label != "config" else "")
        lines.append(f"  {tag:>6} {r['hidden_size']:>6} {r['expert_hidden_size']:>6} {heads:>16} "
                     f"{format_count(r['params_active']):>8} {format_count(r['params_total']):>8} "
                     f"{r['budget_deviation']:>+7.1%} {rate(r['tflops']):>15} {r['tokens_per_s']:>10,.0f} "
                     f"{r['vs_config']:>+9.0%}")
    if rec["best"]:
        b = rec["best"]
        lines.append(f"  -> hidden_size = {b['hidden_size']}, expert_hidden_size = {b['expert_hidden_size']}, "
                     f"num_query_heads = {b['num_query_heads']}, num_kv_heads = {b['num_kv_heads']}, head_dim = "
                     f"{b['head_dim']}; micro-batch {b['micro_batch_tokens']:,} tokens")
    lines.append("  why: " + rec["why"])
    lines.append("  (* = the config's own shape)")
    return lines
