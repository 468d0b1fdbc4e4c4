#!/usr/bin/env bash
# Build the Docker images bytescheduler:pytorch, bytescheduler:horovod and bytescheduler:mxnet.
#
#   usage: scripts/docker_build.sh [pytorch] [horovod] [mxnet]      (default: all three, in that order)
#          scripts/docker_build.sh gpu                              (docker/Dockerfile.gpu: untested)
#
# Needs a running Docker daemon (`make docker` starts one if none runs, see scripts/with_dockerd.sh)
# and the classic builder (no BuildKit needed). The pytorch image is built on $BASE and runs
# `make setup`; the horovod and mxnet images are built on the pytorch image and run `make horovod`
# and `make mxnet`: the same commands, scripts and pins as a checkout and CI use.
#
# What the script sorts out before building:
#   * the base: $BASE (default python:3.11-slim) when present or pullable; otherwise (no Docker Hub,
#     an offline cluster) a Debian bookworm base made with debootstrap from the Debian mirror apt
#     uses, imported as local/bookworm-python (it says so; made once, then reused);
#   * a CA bundle named by PIP_CERT, SSL_CERT_FILE or REQUESTS_CA_BUNDLE (a proxy that intercepts
#     TLS) is staged for pip inside the build;
#   * the host's CPU torch wheel (from pip's find-links) and its cached Horovod wheels are staged,
#     so the images neither download torch nor compile Horovod again (docker/build_env.sh).
# Staged files live in docker/build-extra/ during the build and are removed at the end.
#
# Environment:
#   BASE                   base image (default python:3.11-slim, then local/bookworm-python)
#   DEBIAN_MIRROR          mirror for the local base (default: the one apt is configured with)
#   PIP_INDEX_URL, http_proxy, https_proxy, no_proxy (and upper case)   passed to the build
#   TORCH_INDEX            where images get the CPU torch wheel when the host has none
#                          (default https://download.pytorch.org/whl/cpu)
#   DOCKER_HOST_WHEELS     0: stage no host wheels (torch from TORCH_INDEX, Horovod compiled)
#   BYTESCHEDULER_WHEEL_CACHE  the host's Horovod wheel cache (default ~/.cache/bytescheduler/wheels)
set -euo pipefail

cd "$(dirname "$0")/.."
export DOCKER_BUILDKIT=0  # the classic builder: BuildKit (buildx) is not everywhere
DEFAULT_BASE=python:3.11-slim
LOCAL_BASE=local/bookworm-python
EXTRA=docker/build-extra

log() { echo "docker_build: $*" >&2; }

IMAGES=("$@")
if [ "${#IMAGES[@]}" -eq 0 ]; then
    IMAGES=(pytorch horovod mxnet)
fi
for image in "${IMAGES[@]}"; do
    if [ ! -f "docker/Dockerfile.$image" ]; then
        log "unknown image '$image': choose among pytorch, horovod, mxnet (or gpu)"
        exit 2
    fi
done

if ! docker info >/dev/null 2>&1; then
    log "no Docker daemon is reachable: run 'make docker' (it starts one as root) or start dockerd"
    exit 1
fi

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    local found
    found=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n 1 | tr -d ' ' || true)
    echo "${found:-http://deb.debian.org/debian}"
}

# A Debian bookworm root with Python 3.11 (the same minor version as python:3.11-slim), imported
# as an image. Imported images carry no environment, so PATH and the locale are set here.
make_local_base() {
    if ! command -v debootstrap >/dev/null 2>&1; then
        if [ "$(id -u)" != 0 ]; then
            log "debootstrap is missing; install it (apt-get install debootstrap) or pass BASE=an image you have"
            exit 1
        fi
        log "installing debootstrap (apt-get)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; }
    fi
    local mirror rootfs start
    mirror=$(debian_mirror)
    rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/bookworm-rootfs.XXXXXX")
    ROOTFS_TO_REMOVE=$rootfs
    start=$(date +%s)
    log "building $LOCAL_BASE with debootstrap from $mirror (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -n 20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
    rm -f "$rootfs.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$LOCAL_BASE" >/dev/null
    rm -rf "$rootfs"
    ROOTFS_TO_REMOVE=
    log "made $LOCAL_BASE in $(( $(date +%s) - start )) s"
}

# Sets base (not run in a subshell, so that the cleanup trap sees a half-made root file system).
choose_base() {
    if [ -n "${BASE:-}" ]; then
        image_exists "$BASE" || docker pull "$BASE" >&2 || { log "cannot pull BASE=$BASE"; exit 1; }
        base=$BASE
        return
    fi
    if image_exists "$DEFAULT_BASE" || timeout 120 docker pull "$DEFAULT_BASE" >/dev/null 2>&1; then
        base=$DEFAULT_BASE
        return
    fi
    log "cannot pull $DEFAULT_BASE (no Docker Hub here?): using a local Debian base, $LOCAL_BASE"
    if image_exists "$LOCAL_BASE"; then
        log "$LOCAL_BASE already exists; reusing it"
    else
        make_local_base
    fi
    base=$LOCAL_BASE
}

first_ca_bundle() {
    local file
    for file in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" "${REQUESTS_CA_BUNDLE:-}"; do
        if [ -n "$file" ] && [ -s "$file" ]; then
            echo "$file"
            return
        fi
    done
}

# The host's pip find-links folders (the environment's and pip's configuration).
find_links_dirs() {
    {
        tr ' ' '\n' <<<"${PIP_FIND_LINKS:-}"
        python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z]*\.find-links='\(.*\)'$/\1/p" | tr ' ' '\n'
    } | sed 's|^file://||' | while read -r dir; do
        if [ -n "$dir" ] && [ -d "$dir" ]; then echo "$dir"; fi
    done | sort -u
}

stage_extras() {
    rm -rf "$EXTRA"
    mkdir -p "$EXTRA/ca" "$EXTRA/wheels" "$EXTRA/wheel-cache"
    local ca
    ca=$(first_ca_bundle)
    if [ -n "$ca" ]; then
        cp "$ca" "$EXTRA/ca/ca.crt"
        log "pip in the build trusts the host's CA bundle $ca"
    fi
    if [ "${DOCKER_HOST_WHEELS:-1}" = 0 ]; then
        log "DOCKER_HOST_WHEELS=0: torch comes from ${TORCH_INDEX:-the CPU index}, Horovod is compiled in the image"
        return
    fi
    local dir wheel cache
    while read -r dir; do
        for wheel in "$dir"/torch-*+cpu-*.whl; do
            if [ -f "$wheel" ]; then
                # A hard link where possible: the wheel is large and never modified.
                ln "$wheel" "$EXTRA/wheels/" 2>/dev/null || cp "$wheel" "$EXTRA/wheels/"
                log "staged the host's CPU torch wheel $(basename "$wheel")"
            fi
        done
    done < <(find_links_dirs)
    cache=${BYTESCHEDULER_WHEEL_CACHE:-$HOME/.cache/bytescheduler/wheels}
    for wheel in "$cache"/horovod-*/*/horovod-*.whl; do
        if [ -f "$wheel" ]; then
            local key=${wheel#"$cache"/}
            mkdir -p "$EXTRA/wheel-cache/$(dirname "$key")"
            cp "$wheel" "$EXTRA/wheel-cache/$key"
            log "staged the host's Horovod wheel $key"
        fi
    done
}

ROOTFS_TO_REMOVE=
cleanup() {
    rm -rf "$EXTRA"
    if [ -n "$ROOTFS_TO_REMOVE" ]; then
        rm -rf "$ROOTFS_TO_REMOVE" "$ROOTFS_TO_REMOVE.log"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

base="(CUDA_BASE)"
if [ "${IMAGES[*]}" != gpu ]; then
    choose_base
fi
stage_extras
summary=()
for image in "${IMAGES[@]}"; do
    args=(--network host -f "docker/Dockerfile.$image" -t "bytescheduler:$image")
    if [ "$image" = pytorch ] || [ "$image" = gpu ]; then
        if [ "$image" = pytorch ]; then
            args+=(--build-arg "BASE=$base")
        fi
        if [ -n "${TORCH_INDEX+set}" ]; then
            args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
        fi
    elif ! image_exists bytescheduler:pytorch; then
        log "bytescheduler:$image is built on bytescheduler:pytorch: build that first (scripts/docker_build.sh pytorch $image)"
        exit 1
    fi
    # A proxy and a PyPI mirror reach the build as the host uses them (Docker predefines the proxy
    # variables as build arguments; the Dockerfiles declare PIP_INDEX_URL). file:// indexes are the
    # host's own folders, which a build cannot see.
    for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_INDEX_URL; do
        case "${!var:-}" in
            "" | file:*) ;;
            *) args+=(--build-arg "$var=${!var}") ;;
        esac
    done
    log "building bytescheduler:$image (base $base)"
    start=$(date +%s)
    docker build "${args[@]}" .
    seconds=$(( $(date +%s) - start ))
    size=$(docker image inspect -f '{{.Size}}' "bytescheduler:$image")
    summary+=("$(printf 'bytescheduler:%-8s built in %4d s, %5d MB' "$image" "$seconds" $(( size / 1000000 )))")
done
log "done (base $base):"
printf '  %s\n' "${summary[@]}" >&2
