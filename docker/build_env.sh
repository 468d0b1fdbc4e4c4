#!/bin/sh
# Run one of the project's set-up commands (make setup / horovod / mxnet) inside an image build,
# with pip pointed at what scripts/docker_build.sh staged in docker/build-extra/:
#
#   ca/ca.crt      the CA bundle the host names in PIP_CERT / SSL_CERT_FILE / REQUESTS_CA_BUNDLE
#                  (a TLS-intercepting proxy's CA): given to pip as PIP_CERT;
#   wheels/        the host's CPU torch wheel (from its pip find-links): pip looks there first;
#   wheel-cache/   the host's Horovod wheel cache: scripts/install_horovod.sh uses a wheel whose
#                  key (Horovod, torch and Python versions, machine) matches, else compiles one.
#
# Whatever is staged, torch is pinned to one build of the Makefile's TORCH_PIN: $TORCH_BUILD,
# default cpu (torch==2.13.0 -> torch==2.13.0+cpu), so pip can never pick PyPI's CUDA build.
# Without a staged wheel, that build comes from $TORCH_INDEX (default: PyTorch's CPU index),
# asked only while .venv has no torch yet. The GPU image sets both (e.g. cu130 and its index).
#
#   usage (in a Dockerfile, from /opt/bytescheduler):  RUN sh docker/build_env.sh make setup
set -eu

EXTRA=$(pwd)/docker/build-extra
TORCH_BUILD=${TORCH_BUILD:-cpu}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/$TORCH_BUILD}

# An index given as an empty build argument is no index.
if [ -z "${PIP_INDEX_URL:-}" ]; then
    unset PIP_INDEX_URL
fi
if [ -s "$EXTRA/ca/ca.crt" ]; then
    export PIP_CERT="$EXTRA/ca/ca.crt"
fi
if ls "$EXTRA"/wheels/torch-*.whl >/dev/null 2>&1; then
    export PIP_FIND_LINKS="$EXTRA/wheels"
elif [ -n "$TORCH_INDEX" ] && ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
    # Only while torch is still to be installed: pip would ask this index for every package.
    export PIP_EXTRA_INDEX_URL="$TORCH_INDEX"
fi
mkdir -p "$EXTRA/wheel-cache"
export BYTESCHEDULER_WHEEL_CACHE="$EXTRA/wheel-cache"
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

pin=$(sed -n 's/^TORCH_PIN ?= *//p' Makefile)
case "$pin" in
    torch==*+*) export TORCH_PIN="$pin" ;;
    torch==*) export TORCH_PIN="$pin+$TORCH_BUILD" ;;
    *) echo "build_env: cannot read 'TORCH_PIN ?= torch==VERSION' from the Makefile (found '$pin')" >&2; exit 1 ;;
esac

echo "build_env: $TORCH_PIN; extra wheels from ${PIP_FIND_LINKS:-${PIP_EXTRA_INDEX_URL:-nowhere (PyPI only)}};" \
    "CA bundle ${PIP_CERT:-(pip's own)}"
exec "$@"
