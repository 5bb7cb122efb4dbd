#!/usr/bin/env bash
# Builds the local base image pdserve-base:bookworm (Debian 12 + Python 3.11) with debootstrap
# and `docker import`, for machines that cannot pull python:3.11-slim. Skips if it exists.
#
#   bash scripts/build_base_image.sh            # build once
#   FORCE=1 bash scripts/build_base_image.sh    # rebuild
#
# Needs root (debootstrap) and a reachable Debian mirror: MIRROR, by default the one this host's
# apt uses.
set -euo pipefail

IMAGE=${BASE_IMAGE_TAG:-pdserve-base:bookworm}
SUITE=${SUITE:-bookworm}

# The Debian mirror this host's apt uses (override with MIRROR / SECURITY_MIRROR).
host_mirror() {  # $1: debian or debian-security
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
    2>/dev/null | grep -oE "https?://[^ ]+/$1/?( |$)" | head -1 | tr -d ' ' || true
}
MIRROR=${MIRROR:-$(host_mirror debian)}
SECURITY_MIRROR=${SECURITY_MIRROR:-$(host_mirror debian-security)}
DOCKER=${DOCKER:-docker}

if [[ -z "${FORCE:-}" ]] && "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE exists; skipping (FORCE=1 rebuilds)"
  exit 0
fi
if [[ -z "$MIRROR" ]]; then
  echo "no Debian mirror found in this host's apt sources: set MIRROR=http://.../debian" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null; then
  echo "installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

ROOTFS=$(mktemp -d /var/tmp/pdserve-rootfs.XXXXXX)
trap 'rm -rf --one-file-system "$ROOTFS"' EXIT

echo "debootstrap $SUITE (minbase + python3) into $ROOTFS"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
  tail -30 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; echo "debootstrap failed" >&2; exit 1; }
rm -f "$ROOTFS.log"

# Security updates come from their own suite; the image's apt sees both, like Debian's images.
{
  echo "deb $MIRROR $SUITE main"
  echo "deb $MIRROR $SUITE-updates main"
  [[ -z "$SECURITY_MIRROR" ]] || echo "deb $SECURITY_MIRROR $SUITE-security main"
} >"$ROOTFS/etc/apt/sources.list"

# Slim it down the way the Debian "slim" images do: no package caches, docs, man pages, locales.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin \
  "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/* "$ROOTFS"/usr/share/doc/* \
  "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/tmp/* "$ROOTFS"/root/.cache
find "$ROOTFS"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'C.*' -exec rm -rf {} + 2>/dev/null || true
find "$ROOTFS"/usr/lib/python3* -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null || true
# Container-friendly resolv.conf and hostname are supplied by the engine at run time.
: >"$ROOTFS/etc/resolv.conf"
: >"$ROOTFS/etc/hostname"

echo "importing as $IMAGE"
tar --numeric-owner -C "$ROOTFS" -c . | "$DOCKER" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap $SUITE minbase + python3, python3-venv, ca-certificates" \
  - "$IMAGE" >/dev/null
"$DOCKER" run --rm "$IMAGE" python3 -c 'import sys, venv, ssl; print("base ok:", sys.version.split()[0])'
