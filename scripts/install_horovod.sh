#!/usr/bin/env bash
# Install Horovod (PyTorch + Gloo, CPU only, no MPI) into a Python environment.
#
#   usage: scripts/install_horovod.sh PYTHON          e.g. scripts/install_horovod.sh .venv/bin/python
#
# Horovod 0.28.1 ships only as an sdist, so it has to be compiled against the installed torch
# (several minutes). The wheel is built once and kept in a cache folder keyed by the Horovod,
# torch and Python versions and the machine type, so later runs (a new venv, another checkout,
# CI on the same machine) only install it. A run with a working Horovod already installed,
# built against the torch that is installed now, does nothing.
#
# Two build settings are needed with recent tools:
#   * CMAKE_POLICY_VERSION_MINIMUM=3.5: CMake 4 (from PyPI) rejects gloo's old CMakeLists.
#   * C++17: torch >= 2.1 needs it, but Horovod hard-codes -std=c++14 and strips -std= from
#     CXXFLAGS, so the compiler is wrapped by a script that appends -std=c++17 last.
#
# Environment:
#   BYTESCHEDULER_WHEEL_CACHE  wheel cache (default: $HOME/.cache/bytescheduler/wheels)
#   TORCH_PIN                  torch requirement installed only if torch is missing
#                              (default: torch==2.13.0)
#   HOROVOD_BUILD_JOBS         parallel compile jobs (default: number of CPUs)
#   HOROVOD_GPU_OPERATIONS     NCCL: a CUDA build whose GPU collectives use NCCL (gloo still
#                              coordinates; cache key ...-cuda-nccl). Needs CUDA and NCCL's
#                              headers (CUDA_HOME, HOROVOD_NCCL_HOME); untested by us (no GPU).
#                              Unset (the default): CPU only, gloo.
set -euo pipefail

HOROVOD_VERSION=0.28.1

if [ "$#" -ne 1 ]; then
    echo "usage: $0 PYTHON" >&2
    exit 2
fi
PY=$1
if [ ! -x "$PY" ]; then
    echo "install_horovod: $PY is not an executable Python" >&2
    exit 2
fi
# The environment's own console scripts (cmake from PyPI, horovodrun) come first on PATH.
# Not resolved through symlinks: a venv's python is a link to the base interpreter.
PY_BIN_DIR=$(cd "$(dirname "$PY")" && pwd)
PY="$PY_BIN_DIR/$(basename "$PY")"
export PATH="$PY_BIN_DIR:$PATH"
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "install_horovod: $*"; }
pip_install() { "$PY" -m pip install --quiet "$@"; }

# Verification run after installing (and as the "already done" check): a single-process init.
# Prints the size on its last line of output.
verify() {
    "$PY" -c 'import horovod.torch as hvd; hvd.init(); print(hvd.size())' | tail -n 1
}

# --- torch: Horovod compiles against whatever torch is installed -----------------------------
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    log "torch is not installed; installing ${TORCH_PIN:-torch==2.13.0}"
    pip_install "${TORCH_PIN:-torch==2.13.0}"
fi

# Cache key and the installed state, in one interpreter start (importing torch takes seconds).
read -r TORCH_VERSION PY_TAG MACHINE INSTALLED_HVD BUILT_TORCH < <("$PY" - <<'EOF'
import json, os, platform, sys
import importlib.util
from importlib import metadata
import torch

try:
    hvd = metadata.version("horovod")
except metadata.PackageNotFoundError:
    hvd = "-"
built = "-"
spec = importlib.util.find_spec("horovod")
if spec is not None and spec.origin:
    # Horovod records the framework versions it was compiled against in metadata.json.
    path = os.path.join(os.path.dirname(spec.origin), "metadata.json")
    try:
        with open(path) as fh:
            built = json.load(fh).get("pytorch") or "-"
    except (OSError, ValueError):
        pass
print(torch.__version__, "cp%d%d" % sys.version_info[:2], platform.machine(), hvd, built)
EOF
)

case "${HOROVOD_GPU_OPERATIONS:-}" in
    "") VARIANT=cpu-gloo ;;
    NCCL) VARIANT=cuda-nccl ;;
    *) echo "install_horovod: HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS is not supported (NCCL or unset)" >&2; exit 2 ;;
esac
KEY="horovod-${HOROVOD_VERSION}/torch-${TORCH_VERSION}-${PY_TAG}-${MACHINE}-${VARIANT}"
CACHE_ROOT=${BYTESCHEDULER_WHEEL_CACHE:-$HOME/.cache/bytescheduler/wheels}
CACHE_DIR="$CACHE_ROOT/$KEY"

# --- already installed? ----------------------------------------------------------------------
if [ "$INSTALLED_HVD" = "$HOROVOD_VERSION" ] && [ "$BUILT_TORCH" = "$TORCH_VERSION" ]; then
    if size=$(verify 2>/dev/null) && [ "$size" = "1" ]; then
        log "horovod $HOROVOD_VERSION (built for torch $TORCH_VERSION) is already installed and works"
        exit 0
    fi
    log "horovod $HOROVOD_VERSION is installed but does not initialise; reinstalling"
elif [ "$INSTALLED_HVD" != "-" ]; then
    log "installed horovod $INSTALLED_HVD was built for torch $BUILT_TORCH, not horovod $HOROVOD_VERSION for torch $TORCH_VERSION; reinstalling"
fi

# Horovod's runtime requirements (its wheel is installed with --no-deps below).
RUNTIME_DEPS=(cloudpickle psutil pyyaml packaging)

find_cached_wheel() {
    compgen -G "$CACHE_DIR/horovod-${HOROVOD_VERSION}-*.whl" | head -n 1 || true
}

mkdir -p "$CACHE_DIR"
# One build at a time per cache entry (parallel make runs, two checkouts on one machine).
exec 9>"$CACHE_DIR/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

WHEEL=$(find_cached_wheel)
if [ -n "$WHEEL" ]; then
    log "using cached wheel $WHEEL"
else
    log "building horovod $HOROVOD_VERSION for torch $TORCH_VERSION ($PY_TAG, $MACHINE); this takes several minutes"
    start=$(date +%s)
    pip_install numpy cmake wheel setuptools "${RUNTIME_DEPS[@]}"

    WORK=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    REAL_CXX=$(command -v "${CXX:-g++}") || { echo "install_horovod: no C++ compiler (${CXX:-g++})" >&2; exit 1; }
    # -std=c++17 must be the last argument so it wins over Horovod's -std=c++14.
    cat >"$WORK/cxx" <<EOF
#!/bin/sh
exec "$REAL_CXX" "\$@" -std=c++17
EOF
    chmod +x "$WORK/cxx"

    # The build the cache key names, whatever other HOROVOD_* settings the caller has: CPU-only
    # Gloo, or (cuda-nccl) NCCL for GPU tensors with Gloo for the rest and for coordination.
    unset HOROVOD_GPU HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER HOROVOD_GPU_BROADCAST \
        HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER HOROVOD_WITH_MPI
    if [ "$VARIANT" = cuda-nccl ]; then
        export HOROVOD_GPU=CUDA HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=${HOROVOD_NCCL_LINK:-SHARED}
    else
        unset HOROVOD_GPU_OPERATIONS
    fi
    CXX="$WORK/cxx" \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    HOROVOD_WITH_PYTORCH=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_CPU_OPERATIONS=GLOO \
    MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}" \
        "$PY" -m pip wheel --no-cache-dir --no-deps --no-build-isolation \
        --wheel-dir "$WORK/wheels" "horovod==${HOROVOD_VERSION}"

    built_wheel=$(compgen -G "$WORK/wheels/horovod-${HOROVOD_VERSION}-*.whl" | head -n 1 || true)
    if [ -z "$built_wheel" ]; then
        echo "install_horovod: pip wheel produced no horovod wheel" >&2
        exit 1
    fi
    # Copy then rename, so that the cache never holds a half-written wheel.
    cp "$built_wheel" "$CACHE_DIR/.$(basename "$built_wheel").tmp"
    mv "$CACHE_DIR/.$(basename "$built_wheel").tmp" "$CACHE_DIR/$(basename "$built_wheel")"
    WHEEL="$CACHE_DIR/$(basename "$built_wheel")"
    log "built and cached $WHEEL in $(( $(date +%s) - start )) s"
fi

# --- install and verify ----------------------------------------------------------------------
pip_install "${RUNTIME_DEPS[@]}"
pip_install --no-deps --force-reinstall "$WHEEL"

if ! size=$(verify); then
    echo "install_horovod: horovod was installed from $WHEEL but 'hvd.init()' failed" >&2
    exit 1
fi
if [ "$size" != "1" ]; then
    echo "install_horovod: single-process hvd.size() is '$size', expected 1" >&2
    exit 1
fi
log "horovod $HOROVOD_VERSION installed from $WHEEL; single-process hvd.init() works (size $size)"
