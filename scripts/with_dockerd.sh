#!/usr/bin/env bash
# Run a command with a Docker engine available, starting one for the command's duration if needed.
#
#   usage: scripts/with_dockerd.sh COMMAND [ARGS...]     e.g. scripts/with_dockerd.sh docker info
#
# When `docker info` already reaches a daemon, the command just runs. Otherwise (as root) the
# script installs Debian's docker.io when dockerd is missing, starts dockerd, runs the command and
# stops that daemon again when the command ends, whether it succeeded, failed or was interrupted:
# nothing it started is left running. Images stay in the daemon's data root (/var/lib/docker), so
# a later daemon finds them.
#
# The daemon started here has no default bridge and touches no iptables rules (--bridge=none,
# --iptables=false), so the host's network is left as it was: builds use `--network host`,
# containers `--network none` (the benchmark makes its own network namespaces inside them).
#
# Environment:
#   BYTESCHEDULER_DOCKERD_LOG   where the daemon's log goes (default: a temporary file, removed at
#                               the end; its last lines are shown when the daemon fails to start)
set -euo pipefail

if [ "$#" -eq 0 ]; then
    echo "usage: $0 COMMAND [ARGS...]" >&2
    exit 2
fi

log() { echo "with_dockerd: $*" >&2; }

if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    exec "$@"
fi

if [ "$(id -u)" != 0 ]; then
    log "no Docker daemon is reachable and only root can start one; start it (e.g. 'sudo dockerd &') and retry"
    exit 1
fi

if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    log "installing docker.io (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends docker.io >/dev/null
fi

DAEMON_LOG=${BYTESCHEDULER_DOCKERD_LOG:-$(mktemp "${TMPDIR:-/tmp}/dockerd.XXXXXX.log")}
PIDFILE=/var/run/bytescheduler-dockerd.pid
DAEMON_PID=
COMMAND_PID=

stop_daemon() {
    local status=$?
    trap - EXIT INT TERM
    if [ -n "$COMMAND_PID" ] && kill -0 "$COMMAND_PID" 2>/dev/null; then
        kill -TERM "$COMMAND_PID" 2>/dev/null || true
        wait "$COMMAND_PID" 2>/dev/null || true
    fi
    if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
        # Containers first (a daemon stops them too, but waits for each), then the daemon.
        local running
        running=$(docker ps -q 2>/dev/null || true)
        if [ -n "$running" ]; then
            # shellcheck disable=SC2086
            docker kill $running >/dev/null 2>&1 || true
        fi
        kill -TERM "$DAEMON_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do
            kill -0 "$DAEMON_PID" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$DAEMON_PID" 2>/dev/null; then
            log "dockerd did not stop within 30 s; killing it"
            kill -KILL "$DAEMON_PID" 2>/dev/null || true
        fi
        wait "$DAEMON_PID" 2>/dev/null || true
        log "stopped the Docker daemon it had started (pid $DAEMON_PID)"
    fi
    # The daemon's log helps when the daemon failed, not when the command did.
    if [ "$status" -ne 0 ] && [ -z "$COMMAND_PID" ] && [ -s "$DAEMON_LOG" ]; then
        log "the daemon's log (last lines of $DAEMON_LOG):"
        tail -n 20 "$DAEMON_LOG" >&2
    fi
    if [ -z "${BYTESCHEDULER_DOCKERD_LOG:-}" ]; then
        rm -f "$DAEMON_LOG"
    fi
    exit "$status"
}
trap stop_daemon EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "no Docker daemon running; starting dockerd for this command (it is stopped at the end)"
dockerd --bridge=none --iptables=false --ip-masq=false --pidfile "$PIDFILE" >"$DAEMON_LOG" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 1 120); do
    if docker info >/dev/null 2>&1; then
        break
    fi
    if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
        log "dockerd exited at start"
        exit 1
    fi
    sleep 0.5
done
if ! docker info >/dev/null 2>&1; then
    log "dockerd did not answer within 60 s"
    exit 1
fi
log "dockerd is up (pid $DAEMON_PID, storage driver $(docker info --format '{{.Driver}}'))"

# Not exec: the trap must stop the daemon when the command ends. In the background with `wait`,
# so that a SIGTERM to this script is handled at once (bash runs traps only between commands);
# the command keeps this script's standard input.
"$@" <&0 &
COMMAND_PID=$!
wait "$COMMAND_PID"
