#!/usr/bin/env bash
# The shared libraries the `rdma` extra's transfer engine loads: libibverbs and libnuma
# (Debian packages libibverbs1, libnuma1). Exits 0 when they are there or got installed
# (apt-get, through sudo when not root); otherwise says why and exits 1, and the caller
# installs without the extra (the RDMA tests then skip, saying why).
set -u
ldconfig_bin=$(command -v ldconfig || echo /sbin/ldconfig)
missing=()
for lib_pkg in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1; do
    "$ldconfig_bin" -p 2>/dev/null | grep -q "${lib_pkg%%:*}" || missing+=("${lib_pkg##*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0

warn() { echo "warning: the rdma extra is left out: $*" >&2; exit 1; }
command -v apt-get >/dev/null || warn "${missing[*]} missing and no apt-get to install them"
as_root=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || warn "${missing[*]} missing; installing them needs root (no sudo)"
    as_root=(sudo -n)  # never waits for a password
fi
export DEBIAN_FRONTEND=noninteractive
echo "installing ${missing[*]} (libraries of the rdma extra)" >&2
"${as_root[@]}" apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
    || { "${as_root[@]}" apt-get update -q >/dev/null 2>&1 && "${as_root[@]}" apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; } \
    || warn "apt-get could not install ${missing[*]}"
