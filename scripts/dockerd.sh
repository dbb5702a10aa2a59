#!/usr/bin/env bash
# A Docker daemon for the container tier (make test-containers): `scripts/dockerd.sh start` starts
# one where none answers, `scripts/dockerd.sh stop` stops the one it started and removes what it
# left. Installs docker.io (Debian package) where dockerd is missing.
#
# The daemon runs with --bridge=none --iptables=false: the docker sandbox uses --network none (its
# one reachable service, the proxy, comes through a bind-mounted Unix socket), so the test daemon
# needs no docker0 bridge and no iptables rules, and leaves neither behind (a default dockerd
# leaves both when stopped). Images stay in /var/lib/docker, so a second run reuses them.
# A daemon that was already answering is left alone (and left running by `stop`).
set -euo pipefail
state=/run/fineenvs-dockerd
mkdir -p "$state"
case "${1:-}" in
start)
  if docker version --format '{{.Server.Version}}' >/dev/null 2>&1; then
    echo "dockerd: a daemon already answers; using it"
    exit 0
  fi
  if ! command -v dockerd >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io) >/dev/null
  fi
  ip link show docker0 >/dev/null 2>&1 && touch "$state/had-docker0" || rm -f "$state/had-docker0"
  dockerd --bridge=none --iptables=false --ip6tables=false --pidfile "$state/dockerd.pid" \
    >"$state/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do
    if docker version --format '{{.Server.Version}}' >/dev/null 2>&1; then
      echo "dockerd: started (pid $(cat "$state/dockerd.pid")), log $state/dockerd.log"
      exit 0
    fi
    sleep 0.5
  done
  echo "dockerd: did not answer within 30 s; its log:" >&2
  tail -20 "$state/dockerd.log" >&2
  exit 1
  ;;
stop)
  [ -f "$state/dockerd.pid" ] || { echo "dockerd: not started by this script; nothing to stop"; exit 0; }
  pid=$(cat "$state/dockerd.pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$state/dockerd.pid"
  # Only what this daemon could have made: a docker0 that was not there before it started.
  if [ ! -f "$state/had-docker0" ] && ip link show docker0 >/dev/null 2>&1; then
    ip link delete docker0 || true
  fi
  echo "dockerd: stopped"
  ;;
*)
  echo "usage: scripts/dockerd.sh start|stop" >&2
  exit 2
  ;;
esac
