#!/usr/bin/env bash
# Prometheus and promtool (Debian package `prometheus`) for the test that scrapes a running
# system with a real Prometheus and checks the shipped config, rules and dashboard queries
# (tests/e2e/test_e2e_prometheus.py). Exits 0 when `prometheus` and `promtool` are there or got
# installed (apt-get, through sudo when not root); otherwise says why and exits 1: the caller
# goes on and that test skips, saying why. The package's own service is kept from starting
# (a policy-rc.d for the length of the install): the test runs its own prometheus.
set -u
command -v prometheus >/dev/null && command -v promtool >/dev/null && exit 0

warn() { echo "warning: prometheus not installed (its test will skip): $*" >&2; exit 1; }
command -v apt-get >/dev/null || warn "no apt-get to install it"
as_root=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || warn "installing it needs root (no sudo)"
    as_root=(sudo -n)  # never waits for a password
fi
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then  # invoke-rc.d then starts no service (exit 101: "action forbidden")
    printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null \
        && "${as_root[@]}" chmod 755 "$policy" && made_policy=1
fi
export DEBIAN_FRONTEND=noninteractive
install() { "${as_root[@]}" apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; }
echo "installing prometheus (Debian package: prometheus, promtool)" >&2
install || { "${as_root[@]}" apt-get update -q >/dev/null 2>&1 && install; }
ok=$?
[ "$made_policy" -eq 1 ] && "${as_root[@]}" rm -f "$policy"
[ "$ok" -eq 0 ] || warn "apt-get could not install it"
command -v prometheus >/dev/null && command -v promtool >/dev/null || warn "installed, but not on PATH"
