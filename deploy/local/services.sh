#!/usr/bin/env bash
# Checks that Postgres, Redis and NATS (with JetStream) run on this Debian
# machine and starts (installing the Debian packages first if absent) any
# that does not. Idempotent: running it again with everything up changes
# nothing. Used by `make test`, `make dev` and .ci/run.
set -euo pipefail

PGHOST=${PGHOST:-127.0.0.1}
log() { printf 'services: %s\n' "$*" >&2; }

need_pkg() { # need_pkg BINARY PACKAGE...
  if ! command -v "$1" >/dev/null 2>&1 && [ ! -x "$1" ]; then
    log "installing $*"
    if [ -z "${APT_UPDATED:-}" ]; then apt-get update -qq; APT_UPDATED=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${@:2}" >/dev/null
  fi
}

wait_for() { # wait_for NAME COMMAND...
  local name=$1; shift
  for _ in $(seq 1 60); do
    if "$@" >/dev/null 2>&1; then log "$name is up"; return 0; fi
    sleep 0.5
  done
  log "$name did not come up"; return 1
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Postgres 15 (trust auth on 127.0.0.1 is the machine's default set-up).
need_pkg pg_ctlcluster postgresql
if ! pg_isready -h "$PGHOST" -p 5432 -q 2>/dev/null; then
  log "starting postgres"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n1)" main start || true
fi
wait_for postgres pg_isready -h "$PGHOST" -p 5432 -q

# Redis 7, nothing kept on disk.
need_pkg redis-server redis-server
if ! redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
  log "starting redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi
wait_for redis sh -c 'redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG'

# NATS with JetStream. Tests that need current NATS features embed
# nats-server/v2 instead; this one serves `sluice dev` and general use.
need_pkg /usr/sbin/nats-server nats-server
if ! port_open 4222; then
  log "starting nats-server"
  mkdir -p /var/lib/nats-server
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server
fi
wait_for nats port_open 4222

# Chromium (Debian's package) for the web console's browser tests
# (cmd/sluice/console_test.go drives it headless).
need_pkg chromium chromium
