#!/usr/bin/env bash
# Create the MXNet environment (default .venv-mxnet) used by the parameter-server tests.
#
#   usage: scripts/install_mxnet.sh [VENV_DIR]
#
# MXNet 1.9.1 needs numpy < 1.24 (it uses numpy.bool, removed in 1.24), so it cannot share the
# main .venv, whose numpy is newer. This environment holds mxnet, numpy, pytest, pytest-timeout
# and bytescheduler installed editable, without torch (the core imports no framework).
#
# Idempotent: when the environment already imports mxnet and bytescheduler.core from this
# checkout, and setup.py has not changed since, the script does nothing (about 2 s: one
# import of mxnet).
#
# Environment:
#   PYTHON       interpreter that creates the venv (default: python3)
#   MXNET_PIN    default: mxnet==1.9.1
#   NUMPY_PIN    default: numpy==1.23.5
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${1:-.venv-mxnet}
PYTHON=${PYTHON:-python3}
MXNET_PIN=${MXNET_PIN:-mxnet==1.9.1}
NUMPY_PIN=${NUMPY_PIN:-numpy==1.23.5}
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "install_mxnet: $*"; }

# Prints "ok" when mxnet, numpy, pytest, pytest-timeout and this checkout's bytescheduler import.
verify() {
    BYTESCHEDULER_ROOT="$ROOT" "$PY" - <<'EOF'
import os, sys
import numpy, mxnet, pytest, pytest_timeout  # noqa: F401
import bytescheduler, bytescheduler.core  # noqa: F401
root = os.path.realpath(os.environ["BYTESCHEDULER_ROOT"])
where = os.path.realpath(bytescheduler.__file__)
if not where.startswith(root + os.sep):
    sys.exit(f"bytescheduler comes from {where}, not from {root}")
if "torch" in sys.modules:
    sys.exit("importing bytescheduler.core imported torch")
print("ok", mxnet.__version__, numpy.__version__)
EOF
}

# setup.py's hash at the last editable install: a changed setup.py (a new package or console
# command) needs the editable install again, even when everything still imports.
STAMP="$VENV/.bytescheduler-setup-py.sha256"
setup_hash() { cat setup.py tools/setup.py | sha256sum | cut -d' ' -f1; }
editable_install() {
    log "installing bytescheduler and bytescheduler-tools (editable, no torch)"
    # --no-deps: the library's one requirement, numpy, is installed at MXNet's pin; its test extra
    # and the tools' requirements would pull in torch (the bench's MXNet workers need none).
    "$PY" -m pip install --quiet --no-deps -e . -e ./tools
    setup_hash >"$STAMP"
}

if [ -x "$PY" ] && out=$(verify 2>/dev/null); then
    if [ "$(cat "$STAMP" 2>/dev/null)" = "$(setup_hash)" ]; then
        log "$VENV already works (mxnet $(echo "$out" | cut -d' ' -f2)); nothing to do"
        exit 0
    fi
    log "setup.py changed since $VENV was set up"
    editable_install
    verify >/dev/null
    exit 0
fi

if [ ! -x "$PY" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
"$PY" -m pip install --quiet --upgrade pip setuptools wheel
log "installing $MXNET_PIN $NUMPY_PIN pytest pytest-timeout"
"$PY" -m pip install --quiet "$MXNET_PIN" "$NUMPY_PIN" "pytest>=7" "pytest-timeout>=2"
editable_install

if ! out=$(verify); then
    log "verification failed" >&2
    exit 1
fi
log "$VENV ready: mxnet $(echo "$out" | cut -d' ' -f2), numpy $(echo "$out" | cut -d' ' -f3)"
