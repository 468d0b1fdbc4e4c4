#!/usr/bin/env bash
# The torch adapters on one GPU against DDP on the same GPU, in a few minutes (scripts/gpu_check.py
# says what is checked); --cpu: the same checks on CPU tensors (CI runs that, so the script cannot rot).
#
#   usage: scripts/gpu_check.sh [--cpu] OUT        (PYTHON: the interpreter with torch, default python3)
#
# The project is installed without dependencies into a folder of its own (the machine's torch is
# used; nothing is fetched), then checked; OUT gets table.md, results.json, the logs and the
# timelines. Exits non-zero when any check differs or fails.
set -euo pipefail

cpu=""
if [ "${1:-}" = "--cpu" ]; then cpu="--cpu"; shift; fi
OUT=${1:?usage: scripts/gpu_check.sh [--cpu] OUT}
PY=${PYTHON:-python3}
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # before any cd
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
site=$(mktemp -d)
build=$(mktemp -d)
trap 'rm -rf "$site" "$build"' EXIT
# --no-build-isolation: the GPU machine reaches no index, so setuptools must be its own.
if ! "$PY" -m pip install --quiet --no-deps --no-build-isolation --target "$site" . >"$OUT/install.log" 2>&1; then
    echo "gpu_check: installing the project failed; see $OUT/install.log" >&2
    exit 1
fi
cd "$build"  # so that the installed copy, not the checkout, is what imports
PYTHONPATH="$site" PYTHONUNBUFFERED=1 "$PY" "$OLDPWD/scripts/gpu_check.py" "$OUT" $cpu 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
