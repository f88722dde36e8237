#!/usr/bin/env bash
# Build and import a minimal Debian base image with Python 3.11 for hosts that reach no image
# registry, only their Debian mirror. The mirror is read from this machine's apt sources at run
# time; the certificates this machine trusts (e.g. a TLS-inspecting proxy's CA under
# /usr/local/share/ca-certificates) are trusted inside the image too, so pip works there as it
# does here. An image that already exists is reused.
#
#   deploy/offline-base.sh [IMAGE]        (default pdd-base:bookworm; needs root and debootstrap)
#   docker build --build-arg BASE_IMAGE=pdd-base:bookworm .
set -euo pipefail

IMAGE=${1:-pdd-base:bookworm}
SUITE=bookworm  # Debian 12: its python3 is 3.11
DOCKER=${DOCKER:-docker}

if $DOCKER image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE already present: reused"
    exit 0
fi

mirror() {  # the first Debian archive URI in the apt sources (one-line or deb822 format)
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
    local f
    for f in "${files[@]}"; do
        [ -r "$f" ] || continue
        awk '
            /^deb[ \t]/ { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; break } }
            /^URIs:/    { for (i = 2; i <= NF; i++) print $i }
        ' "$f"
    done | grep -E '/debian/?$' | head -n 1
}

MIRROR=$(mirror)
if [ -z "$MIRROR" ]; then
    echo "no Debian mirror found in /etc/apt/sources.list{,.d}" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

ROOT=$(mktemp -d /tmp/pdd-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
echo "building $IMAGE: Debian $SUITE from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 \
    || { tail -n 20 "$ROOT.log" >&2; rm -f "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"

# This machine's extra CAs, and its mirror for apt inside the image.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
    chroot "$ROOT" update-ca-certificates >/dev/null 2>&1
fi
echo "deb $MIRROR $SUITE main" >"$ROOT/etc/apt/sources.list"
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*

tar -C "$ROOT" -c . | $DOCKER import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$IMAGE" >/dev/null
echo "base image $IMAGE imported"
