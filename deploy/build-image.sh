#!/usr/bin/env bash
# Build pdd:latest, the one image compose runs, online or offline:
# - base: python:3.11-slim when it is present or can be pulled, else the local Debian base
#   that deploy/offline-base.sh builds from this machine's Debian mirror (or $PDD_BASE_IMAGE);
# - CPU torch: the wheel pip finds with this machine's configuration (find-links, index),
#   put into deploy/wheels/, else the PyTorch CPU index.
# Layers are cached by the Docker engine between runs.
#
#   deploy/build-image.sh            (PYTHON=the pip to ask for torch, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER=${DOCKER:-docker}
PYTHON=${PYTHON:-.venv/bin/python}
TORCH=$(sed -n 's/^\s*"\(torch==[^"]*\)".*/\1/p' Dockerfile)  # the Dockerfile's pin, e.g. torch==2.13.0+cpu
UPSTREAM_BASE=python:3.11-slim

. deploy/images.sh

BASE=${PDD_BASE_IMAGE:-}
if [ -z "$BASE" ]; then
    if available "$UPSTREAM_BASE"; then
        BASE=$UPSTREAM_BASE
    else
        BASE=pdd-base:bookworm
        echo "$UPSTREAM_BASE unavailable (no registry): building on $BASE (deploy/offline-base.sh)"
        DOCKER=$DOCKER deploy/offline-base.sh "$BASE"
    fi
fi

TORCH_INDEX_ARG=()
if ! compgen -G "deploy/wheels/torch-*.whl" >/dev/null; then
    "$PYTHON" -m pip download -q --no-deps -d deploy/wheels "$TORCH" 2>/dev/null \
        || echo "no $TORCH wheel from this machine's pip: the image takes it from the PyTorch CPU index"
fi
if compgen -G "deploy/wheels/torch-*.whl" >/dev/null; then
    TORCH_INDEX_ARG=(--build-arg TORCH_INDEX_URL=)  # the wheel is enough
fi

echo "building pdd:latest on $BASE"
# Host networking: pip inside the build reaches PyPI as this machine does, also on an engine
# with no default bridge.
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
if ! $DOCKER build --network host --build-arg BASE_IMAGE="$BASE" "${TORCH_INDEX_ARG[@]}" -t pdd:latest . >"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    exit 1
fi
echo "pdd:latest built"
